"""The ``.llm`` accessor: LLM operators over every row of a dask dataframe.

    import daskllm.dataframe  # noqa: F401  (registers the accessor; ``import daskllm`` does too)
    out = ddf.llm.map("Summarize {doc} in one line:", model="small", max_tokens=32, out="summary")
    out = out.llm.filter("Is this about files? {summary}")
    out.to_parquet("summaries/")

Every operator is lazy and composes with dask's expression optimizer. The LLM operators
added one after another to the same rows are one table job (:mod:`daskllm.dataframe.job`):

1. **render**: each partition renders its rows' prompts (cheap string work) and drops its own
   duplicates;
2. **group**: a shuffle by prompt prefix puts the prompts that share one in one partition,
   whichever rows, partitions and operators they came from (identical prompts too: each is
   called once);
3. **call**: each group partition sorts its prompts and runs them in waves that fit its
   engine's KV cache: the prefixes its calls share, in one prefill-only step, then every call
   at once, then the calls after a filter that it said yes to, so each shared prefix is
   computed once; run
   from the task, on its worker's engines where it holds them (tasks from tasks);
4. **back**: the results go back to the row partitions that asked, which look their rows up.

The output is ``ddf.assign(out=...)``, so a column no later step reads is dropped by dask's
projection pushdown and never generated. A row that fails (prompt too long, output that does
not parse, budget exhausted) raises naming its index (``on_error="raise"``) or yields null
with the reason in ``<out>_error`` (``on_error="null"``); the other rows finish either way.
"""

from daskllm.budget import Budget
from daskllm.dataframe.accessor import LLMAccessor, LLMSeriesAccessor
from daskllm.dataframe.estimate import JobEstimate, OperatorEstimate, TableEstimate, calibrate, estimate
from daskllm.dataframe.progress import progress
from daskllm.dataframe.ops import BudgetExceeded, Op, RowError
from daskllm.dataframe.schema import arrow_types
from daskllm.dataframe import roundtrip

roundtrip.register()  # nested Arrow columns read back from parquet with no reader option

__all__ = ["Budget", "BudgetExceeded", "JobEstimate", "LLMAccessor", "LLMSeriesAccessor", "Op", "OperatorEstimate",
           "RowError",
           "TableEstimate", "arrow_types", "calibrate", "estimate", "progress"]
