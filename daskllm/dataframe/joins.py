"""Similarity join: each left row with the ``k`` right rows nearest by cosine of embeddings."""

from __future__ import annotations

import numpy as np
import pandas as pd

def sim_join(left: pd.DataFrame, right: pd.DataFrame, k: int, suffixes) -> pd.DataFrame:
    lvec, rvec = "_daskllm_left_vec", "_daskllm_right_vec"
    left, right = left[left[lvec].notna()], right[right[rvec].notna()]  # a null text matches nothing
    lcols = [c for c in left.columns if c != lvec]
    rcols = [c for c in right.columns if c != rvec]
    names = {c: c + suffixes[1] if c in lcols else c for c in rcols}
    rows = []
    if len(left) and len(right):
        a = np.stack(left[lvec].tolist())
        b = np.stack(right[rvec].tolist())
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        b = b / np.linalg.norm(b, axis=1, keepdims=True)
        scores = a @ b.T
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        for i, js in enumerate(best):
            for j in js:
                rows.append((i, j, float(scores[i, j])))
    li = [r[0] for r in rows]
    ri = [r[1] for r in rows]
    out = left[lcols].iloc[li].rename(columns={c: c + suffixes[0] for c in lcols})
    joined = right[rcols].iloc[ri].rename(columns=names).set_axis(out.index)
    return pd.concat([out, joined], axis=1).assign(similarity=pd.Series([r[2] for r in rows], index=out.index,
                                                                         dtype="float64"))
