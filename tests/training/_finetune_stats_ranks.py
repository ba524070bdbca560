"""Rank side of the fine-tune statistics test: two gloo ranks, different data per rank.

Rank 1 is handed other structures (and labels): the statistics must still be rank 0's,
computed once and applied identically on both ranks.
"""

from __future__ import annotations

import sys

from _finetune_support import AU, CU, painn, relabelled, structures
from _ranks import init_group, report, teardown

from nvalchemi.training.finetune_statistics import prepare_finetune_model

rank = init_group()
model = painn()
offsets = {CU: 0.123456789, AU: -0.987654321}
data = relabelled(model, structures(10, seed=rank), {z: v * (1 + rank) for z, v in offsets.items()})
stats = prepare_finetune_model(model, data, e0="estimated", run_dir=sys.argv[1])
report(stats=stats.to_dict(), model_e0=model.get_reference_energies())
teardown()
