"""The short module names of moe (moe.gate, moe.gating, ...) are the modules of moe.router and
moe.dispatch, offering the names scripts import from them, in a fresh process."""

import subprocess
import sys

# each short name, its module, and the names it offers
PATHS = {
    "gate": ("moe.router.gate", ["ROUTINGS", "TopKGate", "TopKGateConfig", "update_routing"]),
    "gating": ("moe.router.selection", ["SCORING_FUNCS", "expert_softmax", "top1gating", "top2gating", "topkgating"]),
    "routing": ("moe.router.plan", ["Routing", "assign_slots"]),
    "balancing": ("moe.router.balancing", ["LOAD_BALANCING_TYPES", "balance_fraction", "balance_loss", "max_violation",
                                           "normalized_scores", "update_bias"]),
    "gate_outputs": ("moe.router.outputs", ["gate_outputs"]),
    "expert_choice": ("moe.router.expert_choice", ["expert_choice_capacity", "expert_choice_gating"]),
    "expert_parallel": ("moe.dispatch.expert_parallel", ["Exchange", "check_equal_tokens", "plan_exchange",
                                                         "read_exchange"]),
    "rank_exchange": ("moe.dispatch.per_rank", ["read_pair_exchange"]),
}


def test_each_short_name_is_its_module_with_its_names():
    lines = ["import importlib, moe"]
    for short, (module, names) in PATHS.items():
        lines += [f"import moe.{short}",
                  f"assert moe.{short} is importlib.import_module({module!r}), {short!r}",
                  f"from moe.{short} import {', '.join(names)}"]
    lines.append("print('ok')")
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
