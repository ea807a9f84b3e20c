"""Dispatchers: how tokens travel from the router's plan to their experts and back.

One interface (`Dispatcher.dispatch(x_SM, routing) -> Dispatched`, then the experts, then
`Dispatcher.combine(y_NM, dispatched) -> out_SM`) and one class per way of travelling:

    Padded                the [E, C, M] capacity buffer; fixed size, no host sync
    Packed                kept rows sorted by expert, no padding; one host read of the counts
    Grouped               packed rows in a fixed-size buffer, counts on the device, one grouped GEMM
    PaddedExpertParallel  the capacity buffer in equal all-to-all chunks over the expert-parallel group
    PackedExpertParallel  packed rows in variable chunks, regrouped by local expert on arrival
    PerRankExchange       one row per (token, destination rank), expanded into its choices there

`make_dispatcher` picks one from the layer's settings. A new way (a capacity-less padded layout, a
DeepEP-style exchange) is a new `Dispatcher` subclass and a line in `make_dispatcher`.
"""

from moe.dispatch.base import Dispatched, Dispatcher, TokenRows
from moe.dispatch.expert_parallel import PackedExpertParallel, PaddedExpertParallel
from moe.dispatch.local import Grouped, Packed, Padded
from moe.dispatch.per_rank import PerRankExchange

__all__ = [
    "Dispatched", "Dispatcher", "Grouped", "Packed", "PackedExpertParallel", "Padded", "PaddedExpertParallel",
    "PerRankExchange", "TokenRows", "make_dispatcher",
]


def make_dispatcher(layout: str, exchange: str = "per_choice", ep_size: int = 1, ep_group=None, *,
                    measured: bool = False, stacked: bool = True, equal_tokens: bool = True) -> Dispatcher:
    """The dispatcher for a resolved layout.

    Args:
        layout: "padded", "packed" or "grouped".
        exchange: with ep_size > 1, "per_choice" or "per_rank".
        ep_size, ep_group: the expert-parallel group (ep_group None in one process).
        measured: packed rows run the experts' products as measured fastest on the CPU (the "auto" layout).
        stacked: the experts are stacked weights (the grouped dispatcher's fixed-size buffer needs them).
        equal_tokens: the padded exchange checks that every rank routes as many tokens (dropping only).
    """
    grouped_gemm = True if layout == "grouped" else (None if measured else False)
    if ep_size > 1 and exchange == "per_rank":
        return PerRankExchange(ep_size, ep_group, grouped_gemm)
    if layout == "padded":
        return PaddedExpertParallel(ep_size, ep_group, equal_tokens) if ep_size > 1 else Padded()
    if ep_size > 1:
        return PackedExpertParallel(ep_size, ep_group, grouped_gemm)
    if layout == "grouped" and stacked:
        return Grouped()
    return Packed(grouped_gemm)
