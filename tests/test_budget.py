"""Budgets without a cluster: reservations in this process (the cluster's ledger is tested with
the dataframe operators in test_dataframe.py)."""

from __future__ import annotations

import pickle
import threading

import pytest

from daskllm.budget import Budget


def test_a_reservation_grants_each_call_that_still_fits_in_order():
    budget = Budget(tokens=10, calls=3)
    grant = budget.reserve([4, 4, 4, 2])
    assert grant.granted == (True, True, False, True)
    assert (grant.tokens_used, grant.calls_used) == (10, 3)
    assert budget.reserve([0]).granted == (False,)  # no call left
    assert budget.used() == {"tokens": 10, "calls": 3}


def test_a_budget_is_shared_by_its_copies_and_never_overspent():
    budget = Budget(tokens=250)
    copies = [pickle.loads(pickle.dumps(budget)) for _ in range(8)]  # as partitions get it
    granted = []

    def spend(copy):
        for _ in range(10):
            granted.extend(copy.reserve([3] * 5).granted)

    threads = [threading.Thread(target=spend, args=(c,)) for c in copies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 250 // 3 and budget.used() == {"tokens": 250 // 3 * 3, "calls": 250 // 3}


def test_a_budget_must_be_a_non_negative_int():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="non-negative int"):
            Budget(tokens=bad)
