"""Model cascades for ``filter`` (LOTUS's approach): a cheap proxy model judges every row and
says how sure it is; an oracle model judges a sample, from which two thresholds are learned so
that the proxy's confident answers meet a target precision against the oracle; the rows in
between go to the oracle.

All of it stays lazy: the proxy's table of distinct answers, the sample, the thresholds and the
oracle's table are one-partition frames broadcast to the row partitions, like every ``ddf.llm``
result table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

from daskllm.dataframe.calls import record
from daskllm.dataframe.ops import KEY, STRING
from daskllm.dataframe.rows import lookup

SAMPLE_HASH = "_daskllm_sample_hash"
TABLE = pd.DataFrame({KEY: pd.Series([], dtype=STRING), "value": pd.Series([], dtype=object),
                      "error": pd.Series([], dtype=STRING)})
LEARNED = pd.DataFrame({"low": pd.Series([], dtype=float), "high": pd.Series([], dtype=float),
                        "sample_precision": pd.Series([], dtype=float), "sample_rows": pd.Series([], dtype=int)})


@dataclass(frozen=True)
class Cascade:
    """A proxy model answers the rows it is sure of, an oracle model the rest.

    A row is answered yes by the proxy when its P(yes) is above ``high``, no when below
    ``low``. The thresholds are learned per job from the oracle's answers on ``sample_size``
    distinct prompts (chosen by a hash of the prompt and ``seed``: the same rows every run) so
    that the proxy's yes answers reach ``target_precision`` against the oracle on the sample,
    and its no answers either the same precision or, with ``target_recall``, lose at most that
    share of the oracle's yes rows. ``thresholds=(low, high)`` skips learning (and the sample):
    ``(0.0, 1.0)`` sends every row to the oracle."""

    proxy: str
    oracle: str
    target_precision: float = 0.9
    target_recall: float | None = None
    sample_size: int = 100
    seed: int = 0
    thresholds: tuple[float, float] | None = None

    def __post_init__(self):
        if not 0 < self.target_precision <= 1:
            raise ValueError(f"Cascade: target_precision must be in (0, 1], got {self.target_precision!r}")
        if self.target_recall is not None and not 0 < self.target_recall <= 1:
            raise ValueError(f"Cascade: target_recall must be in (0, 1] or None, got {self.target_recall!r}")
        if not isinstance(self.sample_size, int) or self.sample_size < 1:
            raise ValueError(f"Cascade: sample_size must be a positive integer, got {self.sample_size!r}")
        if self.thresholds is not None:
            low, high = self.thresholds
            if not 0 <= low <= high <= 1:
                raise ValueError(f"Cascade: thresholds must be (low, high) with 0 <= low <= high <= 1, "
                                 f"got {self.thresholds!r}")


# --- the sample ------------------------------------------------------------------------------------


def sample_candidates(frame: pd.DataFrame, seed: int, n: int) -> pd.DataFrame:
    """This partition's ``n`` distinct prompts of smallest hash (the global sample is the ``n``
    smallest of all partitions' candidates)."""
    distinct = frame.dropna(subset=[KEY]).drop_duplicates(subset=[KEY])
    hashes = [int.from_bytes(hashlib.sha256(f"{seed}\0{k}".encode()).digest()[:8], "big") for k in distinct[KEY]]
    return distinct.assign(**{SAMPLE_HASH: np.array(hashes, dtype=np.uint64)}).nsmallest(n, SAMPLE_HASH)


def sample_of(candidates: pd.DataFrame, n: int) -> pd.DataFrame:
    return (candidates.drop_duplicates(subset=[KEY]).nsmallest(n, SAMPLE_HASH)
            .drop(columns=[SAMPLE_HASH]))


# --- thresholds ------------------------------------------------------------------------------------


def learn_thresholds(scores, labels, target_precision: float, target_recall: float | None = None
                     ) -> tuple[float, float]:
    """(low, high): the proxy says yes above ``high``, no below ``low``, so that on this sample
    (proxy P(yes) ``scores``, oracle ``labels``) every stricter cut also meets the targets."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    cuts = np.unique(np.concatenate([scores, [0.0, 1.0]]))
    high = 1.0
    for cut in cuts[::-1]:  # from the strictest down, while the yes answers stay precise enough
        accepted = labels[scores > cut]
        if len(accepted) and accepted.mean() < target_precision:
            break
        high = cut
    low, positives = 0.0, labels.sum()
    for cut in cuts:  # from the strictest up, while the no answers stay right (and recall holds)
        rejected = labels[scores < cut]
        if len(rejected) and (1 - rejected.mean()) < target_precision:
            break
        if target_recall is not None and rejected.sum() > (1 - target_recall) * positives:
            break
        low = cut
    return float(min(low, high)), float(high)


def answers(scores, low: float, high: float, oracle) -> np.ndarray:
    """The cascade's answers: the proxy's where it is sure, else the oracle's (None where not asked)."""
    return np.array([True if s > high else False if s < low else o for s, o in zip(scores, oracle)], dtype=object)


def learn(sample_table: pd.DataFrame, proxy_table: pd.DataFrame, cascade: Cascade) -> pd.DataFrame:
    """The job's thresholds from the sample's oracle answers (rows that failed are left out)."""
    proxy = dict(zip(proxy_table[KEY], proxy_table["value"]))
    pairs = [(proxy[k], v) for k, v in zip(sample_table[KEY], sample_table["value"])
             if v is not None and proxy.get(k) is not None]
    scores, labels = [s for s, _ in pairs], [bool(v) for _, v in pairs]
    low, high = learn_thresholds(scores, labels, cascade.target_precision, cascade.target_recall)
    said = answers(scores, low, high, labels)
    yes = [label for label, a in zip(labels, said) if a]
    precision = float(np.mean(yes)) if yes else float("nan")
    return pd.DataFrame({"low": [low], "high": [high], "sample_precision": [precision], "sample_rows": [len(pairs)]})


def fixed(cascade: Cascade) -> pd.DataFrame:
    low, high = cascade.thresholds
    return pd.DataFrame({"low": [low], "high": [high], "sample_precision": [float("nan")], "sample_rows": [0]})


# --- routing ---------------------------------------------------------------------------------------


def uncertain(keys: pd.Series, proxy_table: pd.DataFrame, sample_table: pd.DataFrame,
              learned: pd.DataFrame) -> pd.Series:
    """The rows' prompts the oracle must answer (null for the others): not in the sample, and
    the proxy unsure (or failed)."""
    low, high = learned["low"].iloc[0], learned["high"].iloc[0]
    proxy = dict(zip(proxy_table[KEY], proxy_table["value"]))
    sampled = set(sample_table[KEY])
    out = [k if isinstance(k, str) and k not in sampled and not _sure(proxy.get(k), low, high) else None
           for k in keys]
    return pd.Series(out, index=keys.index, dtype=STRING, name=KEY)


def _sure(score, low: float, high: float) -> bool:
    return score is not None and (score > high or score < low)


def settle(oracle_table: pd.DataFrame, proxy_table: pd.DataFrame, sample_table: pd.DataFrame,
           learned: pd.DataFrame) -> pd.DataFrame:
    """Record the job's oracle calls saved (once: this runs on the one-partition tables) and
    pass the thresholds on."""
    oracle_calls = len(sample_table) + len(oracle_table)
    record("filter-cascade", distinct=len(proxy_table), extra={
        "oracle_calls": oracle_calls, "oracle_calls_saved": len(proxy_table) - oracle_calls,
        "low": float(learned["low"].iloc[0]), "high": float(learned["high"].iloc[0]),
        "sample_precision": float(learned["sample_precision"].iloc[0]),
        "sample_rows": int(learned["sample_rows"].iloc[0])})
    return learned


def decide(keys: pd.Series, proxy_table: pd.DataFrame, sample_table: pd.DataFrame, oracle_table: pd.DataFrame,
           learned: pd.DataFrame, on_error: str) -> pd.DataFrame:
    """Each row's answer and error: the oracle's for sampled and unsure rows, else the proxy's."""
    low, high = learned["low"].iloc[0], learned["high"].iloc[0]
    proxy = lookup(keys, None, proxy_table, "filter-proxy", "null")
    sampled = set(sample_table[KEY])  # already answered by the oracle: its answer is used
    oracle_rows = [isinstance(k, str) and (k in sampled or not _sure(s, low, high))
                   for k, s in zip(keys, proxy["value"])]
    answered = pd.concat([sample_table, oracle_table[list(sample_table.columns)]])
    oracle = lookup(keys.where(oracle_rows), None, answered, "filter-oracle", on_error)
    value = [o if ask else (s > high) if s is not None else None
             for ask, s, o in zip(oracle_rows, proxy["value"], oracle["value"])]
    error = [o if ask else p for ask, p, o in zip(oracle_rows, proxy["error"], oracle["error"])]
    if len(keys):
        asked = sum(oracle_rows)
        record("filter-cascade", rows=len(keys), extra={"proxy_rows": sum(isinstance(k, str) for k in keys) - asked,
                                                         "oracle_rows": asked})
    return pd.DataFrame({"value": pd.Series(value, index=keys.index, dtype=object),
                         "error": pd.Series(error, index=keys.index, dtype=STRING)})
