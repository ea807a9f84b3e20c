"""All-to-all traffic of group-limited routing: how many expert-parallel ranks a token reaches.

    python -m recipes.bench.routing --experts 64 --k 8 --ep 8 --hidden 2048 --dtype bf16

With expert parallelism over `ep` ranks and n_group = ep (one group per rank), a token keeps
topk_group groups, so it reaches at most topk_group ranks. For each topk_group (and no limit) this
prints, per token and direction of the exchange (dispatch; the combine sends as much back):
    choices:       rows an exchange with one row per (token, choice) sends off the rank;
    ranks:         rows an exchange with one row per (token, destination rank) sends off the rank
                   (the token copied once per rank, its choices expanded there);
    bytes:         the two in bytes at --hidden and --dtype, and what the limit saves against no limit.
Routing is by a router of random weights on random tokens (a near-uniform load), with the given
--bias-spread of expert bias. The layer's own exchange (moe.dispatch.expert_parallel) sends one row per
(token, choice): a limit on groups changes which ranks a token reaches, not how many rows it sends.
"""

from dataclasses import dataclass, field

import torch

from moe import topkgating
from recipes.common import records
from recipes.common.cli import fail, flag_parser, require_at_least

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(kw_only=True)
class BenchConfig:
    tokens: int = 8192
    hidden: int = 2048
    experts: int = 64
    k: int = 8
    ep: int = 8
    dtype: str = field(default="bf16", metadata={"choices": list(BYTES)})
    scoring_func: str = field(default="sigmoid", metadata={"choices": ["softmax", "sigmoid"]})
    bias_spread: float = 0.0
    seed: int = 0


def rows_per_token(expert_SK: torch.Tensor, num_experts: int, ep: int, source_rank_S: torch.Tensor) -> tuple[float, float]:
    """Rows leaving each token's rank: one per (token, choice), and one per distinct (token, rank)."""
    rank_SK = torch.where(expert_SK >= 0, expert_SK // (num_experts // ep), -1)
    remote_SK = (rank_SK >= 0) & (rank_SK != source_rank_S.unsqueeze(1))
    reached_SR = torch.zeros(expert_SK.shape[0], ep, dtype=torch.bool)
    reached_SR[torch.arange(expert_SK.shape[0]).unsqueeze(1).expand_as(rank_SK)[remote_SK], rank_SK[remote_SK]] = True
    return float(remote_SK.sum(1).double().mean()), float(reached_SR.sum(1).double().mean())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = flag_parser(BenchConfig, __doc__)
    parser.prog = "recipes.bench.routing"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = BenchConfig(**vars(args))
    require_at_least(parser, cfg, ("tokens", "hidden", "experts", "ep"))
    if cfg.experts % cfg.ep:
        fail(parser, f"--experts ({cfg.experts}) must be divisible by --ep ({cfg.ep})")
    if not 1 <= cfg.k <= cfg.experts:
        fail(parser, f"--k ({cfg.k}) must be between 1 and --experts ({cfg.experts})")
    g = torch.Generator().manual_seed(cfg.seed)
    logits = torch.randn(cfg.tokens, cfg.hidden, generator=g) @ (torch.randn(cfg.hidden, cfg.experts, generator=g)
                                                                 / cfg.hidden ** 0.5)
    bias = (torch.rand(cfg.experts, generator=g) - 0.5) * 2 * cfg.bias_spread
    source = torch.arange(cfg.tokens) * cfg.ep // cfg.tokens  # tokens spread evenly over the ranks
    per_row = cfg.hidden * BYTES[cfg.dtype]
    print(f"E={cfg.experts} k={cfg.k} ep={cfg.ep} n_group={cfg.ep} hidden={cfg.hidden} {cfg.dtype}; rows and bytes "
          f"leaving a token's rank per token, each direction")
    print(f"{'topk_group':>10} {'choices':>8} {'ranks':>7} {'bytes/choice':>13} {'bytes/rank':>11} {'saved vs none':>14}")
    results, unlimited = [], None
    limits = sorted({t for t in (cfg.ep // 2, cfg.ep // 4, 2, 1) if t >= 1 and t * cfg.experts // cfg.ep >= cfg.k}, reverse=True)
    for topk_group in [None] + limits:
        groups = dict(n_group=cfg.ep, topk_group=topk_group) if topk_group else {}
        plan = topkgating(logits, cfg.k, 1.0, 0, drop_tokens=False, scoring_func=cfg.scoring_func, expert_bias=bias,
                          **groups)
        choices, ranks = rows_per_token(plan.expert_idx_SK, cfg.experts, cfg.ep, source)
        unlimited = unlimited or ranks
        row = {"topk_group": topk_group or cfg.ep, "choices": choices, "ranks": ranks,
               "bytes_choices": choices * per_row, "bytes_ranks": ranks * per_row, "saved": 1 - ranks / unlimited}
        results.append(row)
        print(f"{str(topk_group or 'none'):>10} {choices:8.2f} {ranks:7.2f} {row['bytes_choices']:13,.0f} "
              f"{row['bytes_ranks']:11,.0f} {row['saved']:14.1%}")
    records.record_run(record_dir, "bench_routing", "recipes.bench.routing", argv, results)
    return results


if __name__ == "__main__":
    main()
