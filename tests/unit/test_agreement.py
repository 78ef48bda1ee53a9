"""The agreement module in one process: typed problems, exact codes, disagreement checks, messages.

The collectives themselves run on gloo groups in tests/distributed (lookups, shard_module, sub-meshes);
without a process group every call sees one rank, which is what these tests pin down.
"""

import math

import pytest
import torch

from torchrec_dtensor_bridge import agreement
from torchrec_dtensor_bridge.agreement import Problem, ProblemKind, Rejected, check_same, float_code


@pytest.mark.parametrize("exc,kind", [
    (TypeError, ProblemKind.BAD_TYPE),
    (ValueError, ProblemKind.BAD_VALUE),
    (NotImplementedError, ProblemKind.UNSUPPORTED),
    (RuntimeError, ProblemKind.FAILURE),
    (KeyError, ProblemKind.FAILURE),
])
def test_rejected_carries_a_typed_problem(exc, kind):
    r = Rejected(exc, "f: table 't': bad")
    assert r.problem == Problem(kind, "f: table 't': bad", exc)
    assert r.exception is exc and r.message == "f: table 't': bad"
    err = r.problem.error()
    assert type(err) is exc and err.args == ("f: table 't': bad",)


def test_problem_default_exception_per_kind():
    assert Problem.of(ProblemKind.DISAGREEMENT, "x").exception is ValueError
    assert Problem.of(ProblemKind.INCOMPLETE, "x", IOError).exception is IOError
    again = Rejected.of(Problem.of(ProblemKind.UNSUPPORTED, "m"))
    assert again.problem == Problem(ProblemKind.UNSUPPORTED, "m", NotImplementedError)


def test_float_code_is_exact():
    values = [0.0, -0.0, 1.0, 1e-300, 2.0**60 + 1, math.inf, -math.inf, 0.1 + 0.2]
    codes = [float_code(v) for v in values]
    assert len(set(codes)) == len(values)  # -0.0 differs from 0.0, 0.1 + 0.2 from 0.3
    assert float_code(0.1 + 0.2) != float_code(0.3)
    assert float_code(math.nan) == float_code(math.nan)
    assert all(-(2**63) <= c < 2**63 for c in codes)


def test_check_same_names_the_values_in_rank_order():
    check_same("f", "mode", [1, 1, 1])
    with pytest.raises(ValueError, match=r"f: ranks disagree on mode: \['sum', 'max'\] \(rank order\)"):
        check_same("f", "mode", [0, 2], shown=["sum", "max"])


def test_agree_on_one_rank_returns_the_values_and_raises_the_problem():
    assert not torch.distributed.is_initialized()
    assert agreement.agree("f", None, [3, -1, 2**62], None) == [[3, -1, 2**62]]
    assert agreement.agree("f", None, [1, 2], None, width=5) == [[1, 2]]
    assert agreement.agree("f", None, [1, 2, 3], None, width=2) == [[1, 2]]
    with pytest.raises(NotImplementedError, match="^f: no$"):
        agreement.agree("f", Problem.of(ProblemKind.UNSUPPORTED, "f: no"), [1], None)
    assert agreement.exchange([4, 5], None) == [[4, 5]]
    assert agreement.gather_objects({"a": 1}, None) == [{"a": 1}]


def test_raise_if_any_lists_every_message_once_with_its_ranks():
    agreement.raise_if_any("save", [], None)
    problems = [Problem.of(ProblemKind.BAD_VALUE, "x is bad"), Problem.of(ProblemKind.BAD_VALUE, "x is bad")]
    with pytest.raises(ValueError, match=r"save:\n  x is bad \(ranks 0, 0\)"):
        agreement.raise_if_any("save", problems, None)

    class Mine(Exception):
        pass

    mixed = [Problem.of(ProblemKind.BAD_VALUE, "a"), Problem.of(ProblemKind.INCOMPLETE, "b", Mine)]
    with pytest.raises(RuntimeError, match=r"load:\n  a \(rank 0\)\n  b \(rank 0\)"):
        agreement.raise_if_any("load", mixed, None)
