import pytest

from moe_ft.state import Level, OperatorId, OperatorInfo


def test_operator_id_roundtrip_and_order():
    ops = [OperatorId.embedding(), OperatorId.dense(0), OperatorId.gate(0), OperatorId.expert_op(0, 3),
           OperatorId.output()]
    for op in ops:
        assert OperatorId.parse(str(op)) == op
    assert str(OperatorId.expert_op(2, 7)) == "expert.L2.E7"
    assert Level.FULL > Level.COMPUTE > Level.NONE


def test_operator_id_validation():
    with pytest.raises(ValueError):
        OperatorId("expert", 1)
    with pytest.raises(ValueError):
        OperatorId("embedding", 0)
    with pytest.raises(ValueError):
        OperatorId.parse("expert.Lx.E1")


def test_operator_info_nbytes():
    info = OperatorInfo(op=OperatorId.gate(1), bytes_compute=10, bytes_full=40)
    assert [info.nbytes(lv) for lv in (Level.NONE, Level.COMPUTE, Level.FULL)] == [0, 10, 40]
