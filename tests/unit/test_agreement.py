"""The agreement module in one process: typed problems, exact codes, disagreement checks, messages.

The collectives themselves run on gloo groups in tests/distributed (lookups, shard_module, sub-meshes);
without a process group every call sees one rank, which is what these tests pin down.
"""

import math
import pickle

import pytest
import torch

from torchrec_dtensor_bridge import agreement
from torchrec_dtensor_bridge.agreement import Problem, ProblemKind, Rejected, check_same, float_code
from torchrec_dtensor_bridge.checkpoint import agree as ckpt_agree
from torchrec_dtensor_bridge.checkpoint.errors import (
    CheckpointBusyError,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
)


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


def test_raise_gathered_lists_common_problems_after_the_ranks_and_names_no_rank_for_them():
    agreement.raise_gathered("save", [[], []], None)
    common = [Problem.of(ProblemKind.DISAGREEMENT, "key 'w': ranks disagree")]
    with pytest.raises(ValueError, match=r"^save:\n  key 'w': ranks disagree$"):
        agreement.raise_gathered("save", [[]], None, common=common)
    mine = [Problem.of(ProblemKind.BAD_VALUE, "x is bad")]
    with pytest.raises(ValueError, match=r"^save:\n  x is bad \(rank 0\)\n  key 'w': ranks disagree$"):
        agreement.raise_gathered("save", [mine], None, common=common)
    odd = [Problem.of(ProblemKind.FAILURE, "disk", OSError)]
    with pytest.raises(KeyError, match="disk"):
        agreement.raise_gathered("save", [odd], None, common=common, mixed=KeyError)


# ---------------------------------------------------------------- the checkpoint's kinds on this module


@pytest.mark.parametrize("kind,problem_kind,exc", [
    (ckpt_agree.Kind.VALUE, ProblemKind.BAD_VALUE, ValueError),
    (ckpt_agree.Kind.INCOMPLETE, ProblemKind.INCOMPLETE, IncompleteCheckpointError),
    (ckpt_agree.Kind.CORRUPT, ProblemKind.FAILURE, CorruptCheckpointError),
    (ckpt_agree.Kind.BUSY, ProblemKind.FAILURE, CheckpointBusyError),
    (ckpt_agree.Kind.IO, ProblemKind.FAILURE, CheckpointError),
    (ckpt_agree.Kind.NOT_A_CHECKPOINT, ProblemKind.FAILURE, NotACheckpointError),
    (ckpt_agree.Kind.NOT_A_DIRECTORY, ProblemKind.BAD_VALUE, NotADirectoryError),
])
def test_checkpoint_problems_are_agreement_problems(kind, problem_kind, exc):
    p = ckpt_agree.Problem(kind, "data file __0_0.distcp, key 'w': bad")
    assert isinstance(p, Problem) and p.kind is problem_kind and p.exception is exc
    assert pickle.loads(pickle.dumps(p)) == p  # gathered between ranks
    with pytest.raises(exc, match=r"^load\(/c\) refused:\n  data file __0_0.distcp, key 'w': bad \(rank 0\)$"):
        ckpt_agree.raise_if_any([p], None, "load(/c) refused")


def test_checkpoint_problem_from_an_exception_keeps_its_type_and_names_the_errno():
    cases = [
        (CheckpointBusyError("/c is being saved"), CheckpointBusyError, "at /c: /c is being saved"),
        (IncompleteCheckpointError("no checkpoint at /c"), IncompleteCheckpointError, "at /c: no checkpoint at /c"),
        (NotACheckpointError("/c is not a checkpoint"), NotACheckpointError, "at /c: /c is not a checkpoint"),
        (CorruptCheckpointError("bad"), CorruptCheckpointError, "at /c: bad"),
        (FileNotFoundError(2, "No such file or directory", "/c/x"), CheckpointError,
         "at /c: OSError [2 ENOENT] [Errno 2] No such file or directory: '/c/x'"),
        (CheckpointError("rename failed"), CheckpointError, "at /c: rename failed"),
        (KeyError("w"), CorruptCheckpointError, "at /c: KeyError: 'w'"),
    ]
    for e, exc, message in cases:
        p = ckpt_agree.problem_from(e, "at /c")
        assert (p.exception, p.message) == (exc, message)


def test_checkpoint_problems_of_different_kinds_raise_checkpoint_error_with_every_message():
    problems = [ckpt_agree.Problem(ckpt_agree.Kind.VALUE, "key 'a' is not in the checkpoint"),
                ckpt_agree.Problem(ckpt_agree.Kind.CORRUPT, "data file f is truncated")]
    with pytest.raises(CheckpointError) as info:
        ckpt_agree.raise_gathered("load(/c)", [problems], None)
    assert type(info.value) is CheckpointError
    assert str(info.value) == ("load(/c):\n  key 'a' is not in the checkpoint (rank 0)\n"
                               "  data file f is truncated (rank 0)")


def test_checkpoint_steps_need_this_rank_in_the_group():
    assert ckpt_agree.member_group(None, "save(/c)").members == (0,)
    assert ckpt_agree.from_rank0({"name": "g"}, None) == {"name": "g"}
