"""The budgets of expensive request work: the worker-process pool (time, memory, cancellation,
exceptions as raised), the size budget of structured outputs, the prompt-logprobs budget, the
bounded listing of a bad logit_bias, and grammar outputs written along a derivation."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
from lark import Lark

from tests.conftest import scaled
from vllm_vcr.frontend.errors import HTTPError
from vllm_vcr.frontend.isolated import BudgetExceeded, IsolatedPool
from vllm_vcr.frontend.protocol import RequestValueError, token_choice_params
from vllm_vcr.frontend.request_checks import MAX_PROMPT_LOGPROB_ENTRIES, check_prompt_logprobs_budget
from vllm_vcr.frontend.structured import sizes
from vllm_vcr.frontend.structured.grammar import grammar_instance

AMBIGUOUS = "start: e\ne: " + " | ".join(["e e"] * 10 + ['"a"'] * 10) + "\n"


# ---- worker processes ----------------------------------------------------------------------------

def _spin() -> None:
    while True:
        pass


def _hold(mb: int) -> None:
    block = bytearray(mb * 1024 * 1024)  # touched: resident
    _spin()
    del block


_KEPT: list[bytearray] = []


def _grow_and_pid(mb: int) -> int:
    _KEPT.append(bytearray(mb * 1024 * 1024))  # kept: the worker stays grown
    return os.getpid()


def _raise_request_error() -> None:
    raise RequestValueError("bad value", "logit_bias", 7)


def _pid() -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def pool():
    p = IsolatedPool(workers=1, memory_mb=200, recycle_mb=64)
    yield p
    p.close()


def test_answer_and_exceptions_come_back_as_raised(pool):
    async def main():
        assert await pool.run(sum, [1, 2, 3], timeout=scaled(30)) == 6
        with pytest.raises(RequestValueError) as e:
            await pool.run(_raise_request_error, timeout=scaled(30))
        return e.value

    error = asyncio.run(main())
    assert str(error) == "bad value (parameter=logit_bias, value=7)" and error.param == "logit_bias"


def test_over_time_the_worker_is_killed_and_replaced(pool):
    async def main():
        first = await pool.run(_pid, timeout=scaled(30))
        with pytest.raises(BudgetExceeded) as e:
            await pool.run(_spin, timeout=0.5)
        second = await pool.run(_pid, timeout=scaled(30))
        return first, e.value, second

    first, error, second = asyncio.run(main())
    assert error.reason == "time" and error.seconds == 0.5
    assert first != second  # a fresh worker
    assert not _alive(first) or pytest.fail(f"worker {first} still runs")


def test_over_memory_the_worker_is_killed(pool):
    async def main():
        with pytest.raises(BudgetExceeded) as e:
            await pool.run(_hold, 400, timeout=scaled(60))
        return e.value

    assert asyncio.run(main()).reason == "memory"


def test_a_grown_worker_retires_after_its_answer(pool):
    """Past recycle_mb the worker answers, then exits; the next call gets a fresh one, no error."""
    async def main():
        grown = await pool.run(_grow_and_pid, 100, timeout=scaled(30))
        fresh = await pool.run(_pid, timeout=scaled(30))
        return grown, fresh

    grown, fresh = asyncio.run(main())
    assert grown != fresh


def test_a_cancelled_call_kills_its_worker(pool):
    async def main():
        pid = await pool.run(_pid, timeout=scaled(30))
        task = asyncio.ensure_future(pool.run(_spin, timeout=scaled(60)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    pid = asyncio.run(main())
    for _ in range(100):
        if not _alive(pid):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not _alive(pid)


def test_errors_pickle_with_their_attributes():
    e = pickle.loads(pickle.dumps(RequestValueError("m", "p", 1)))
    assert (str(e), e.param) == ("m (parameter=p, value=1)", "p")
    h = pickle.loads(pickle.dumps(HTTPError(413, "too large", "RequestEntityTooLarge")))
    assert (h.status, h.message, h.err_type, h.body()) == (413, "too large", "RequestEntityTooLarge", h.body())


# ---- size budget of structured outputs ------------------------------------------------------------

def test_constraints_within_the_size_budget_pass():
    sizes.check_sizes({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                      {"regex": "a+", "grammar": 'root ::= "a"', "choice": ["x", "y"]})


@pytest.mark.parametrize("kind,value,start", [
    ("regex", "a" * (sizes.MAX_CONSTRAINT_CHARS + 1), "Failed to transform regex into a grammar: "),
    ("grammar", "".join(f'r{i} ::= "a"\n' for i in range(sizes.MAX_GRAMMAR_RULES + 1)),
     "Invalid grammar specification: "),
    ("json", {"type": "object", "properties": {f"p{i}": {} for i in range(sizes.MAX_SCHEMA_NODES)}},
     "Failed to transform json schema into a grammar: "),
    ("json", {"enum": ["x" * 1000] * 300}, "Failed to transform json schema into a grammar: "),
    ("structural_tag", "x" * (sizes.MAX_CONSTRAINT_CHARS + 1), "Invalid structural tag specification: "),
])
def test_over_the_size_budget_is_a_400(kind, value, start):
    with pytest.raises(RequestValueError) as e:
        sizes.check_sizes(None, {kind: value})
    assert str(e.value).startswith(start) and e.value.param is None


def test_size_count_stops_at_the_limit():
    """A deep or wide schema is counted only up to just past the limit."""
    huge = [list(range(1000))] * 10_000  # 10 million values, shared
    nodes, _ = sizes._schema_size(huge)
    assert nodes == sizes.MAX_SCHEMA_NODES + 1


# ---- prompt logprobs and logit_bias ---------------------------------------------------------------

def test_prompt_logprobs_budget():
    check_prompt_logprobs_budget(None, 10**9, 100)
    check_prompt_logprobs_budget(20, MAX_PROMPT_LOGPROB_ENTRIES // 21, 100)
    with pytest.raises(RequestValueError) as e:
        check_prompt_logprobs_budget(20, 192_000, 100)
    assert e.value.param == "prompt_logprobs"
    assert str(e.value).startswith("Requested prompt logprobs for 192000 prompt tokens with 20 logprobs each "
                                   "(4032000 entries), which is greater than max allowed per request: ")


class _Req:
    def __init__(self, bias):
        self.logit_bias = bias
        self.allowed_token_ids = None


def test_logit_bias_error_as_vllm_words_it():
    with pytest.raises(RequestValueError) as e:
        token_choice_params(_Req({"5": 1.0, "12": 2.0, "99": 1.0}), 10)
    assert str(e.value) == ("token_id(s) [12, 99] in logit_bias contain out-of-vocab token ids. Vocabulary size: 10 "
                            "(parameter=logit_bias, value=[12, 99])")


def test_logit_bias_error_lists_at_most_100_ids():
    with pytest.raises(RequestValueError) as e:
        token_choice_params(_Req({str(i): 1.0 for i in range(100_000)}), 10)
    listed = ", ".join(str(i) for i in range(10, 110))
    assert str(e.value).startswith(f"token_id(s) [{listed}, ... (99990 in all)] in logit_bias contain ")
    assert len(str(e.value)) < 2000


# ---- grammar outputs along a derivation ------------------------------------------------------------

def test_ambiguous_grammar_output_is_in_its_language():
    """`e: e e | "a"` (ten of each) is a^n, massively ambiguous: Earley parsing a sample of it took
    41 s. The text is written along a derivation, so it is never parsed back."""
    texts = {grammar_instance(AMBIGUOUS, seed) for seed in range(4)}
    assert all(t and set(t) == {"a"} for t in texts)
    small = Lark(AMBIGUOUS, start="start", parser="earley", ambiguity="resolve")
    for t in texts:
        if len(t) <= 12:  # checking a short one here is cheap
            small.parse(t)
