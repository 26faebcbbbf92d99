"""The ``.llm`` accessor: LLM operators over every row of a dask dataframe.

    import daskllm.dataframe  # noqa: F401  (registers the accessor; ``import daskllm`` does too)
    out = ddf.llm.map("Summarize {doc} in one line:", model="small", max_tokens=32, out="summary")
    out = out.llm.filter("Is this about files? {summary}")
    out.to_parquet("summaries/")

Every operator is lazy and composes with dask's expression optimizer. How one runs:

1. **render**: each partition renders its rows' prompts (cheap string work);
2. **distinct**: ``drop_duplicates`` over the whole table (a Dask tree reduction): identical
   prompts anywhere in the table become one call (CSE across rows and partitions);
3. **call**: each partition of distinct prompts, sorted by prompt so shared prefixes are
   adjacent, becomes one batched daskllm call, planned and placed like any daskllm work (the
   shared instruction prefilled once per worker, shards placed with model and cache
   locality by the placement plugin), run from the task (tasks from tasks);
4. **fan out**: the (small) table of results is broadcast to the row partitions, which look
   their rows up.

The output is ``ddf.assign(out=...)``, so a column no later step reads is dropped by dask's
projection pushdown and never generated. A row that fails (prompt too long, output that does
not parse, budget exhausted) raises naming its index (``on_error="raise"``) or yields null
with the reason in ``<out>_error`` (``on_error="null"``); the other rows finish either way.
"""

from daskllm.budget import Budget
from daskllm.dataframe.accessor import LLMAccessor, LLMSeriesAccessor
from daskllm.dataframe.estimate import OperatorEstimate, TableEstimate, calibrate, estimate
from daskllm.dataframe.progress import progress
from daskllm.dataframe.ops import BudgetExceeded, Op, RowError
from daskllm.dataframe.schema import arrow_types
from daskllm.dataframe import roundtrip

roundtrip.register()  # nested Arrow columns read back from parquet with no reader option

__all__ = ["Budget", "BudgetExceeded", "LLMAccessor", "LLMSeriesAccessor", "Op", "OperatorEstimate", "RowError",
           "TableEstimate", "arrow_types", "calibrate", "estimate", "progress"]
