"""The async-save stager: keeps its host buffers from save to save and copies any state a checkpoint holds.

torch 2.11's DefaultStager released its copier after every stage, so the second async save of every GPU run raised
`KeyError: <class 'type'>` (the copier's type table was emptied). These tests pin what a run needs of the stager on
any torch: three stages in a row, class objects in the state, the same buffers refilled with the new values.
"""

from __future__ import annotations

import torch

from physreason.train.checkpoint import ReusingStager


def state(weight: torch.Tensor, moment: torch.Tensor) -> dict:
    # A class object and plain values, as schedulers' and optimizers' state dicts carry them
    return {"model": {"w": weight}, "optim": {"state": {"w": {"exp_avg": moment, "step": 3}}},
            "scheduler": {"base_lrs": [1e-3], "kind": torch.optim.lr_scheduler.LambdaLR, "_get_lr_called": True}}


def test_three_stages_in_a_row_reuse_the_buffers_and_copy_the_new_values():
    weight, moment = torch.zeros(4, 3), torch.ones(7)
    stager = ReusingStager(pin_memory=False)
    pointers = []
    for _save in range(3):
        weight.add_(1.0)  # training changed the tensors in place between saves
        moment.mul_(2.0)
        staged = stager.stage(state(weight, moment))
        assert staged["model"]["w"] is not weight and torch.equal(staged["model"]["w"], weight)
        assert torch.equal(staged["optim"]["state"]["w"]["exp_avg"], moment)
        assert staged["scheduler"]["kind"] is torch.optim.lr_scheduler.LambdaLR
        assert staged["optim"]["state"]["w"]["step"] == 3
        pointers.append((staged["model"]["w"].data_ptr(), staged["optim"]["state"]["w"]["exp_avg"].data_ptr()))
        weight.add_(100.0)  # a change after staging does not reach the staged copy
        assert not torch.equal(staged["model"]["w"], weight)
        weight.sub_(100.0)
    assert pointers[0] == pointers[1] == pointers[2]  # one host copy for the whole run, refilled at each save
    assert stager.stages == 3
    assert not stager.should_synchronize_after_execute
    stager.close()
