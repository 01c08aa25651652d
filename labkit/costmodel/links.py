"""The cost model's communication half: links (alpha, bus bandwidth), the ring's alpha-beta
collective times, and the fit of alpha and beta to measured times. labkit.costmodel.step_time
uses it; what it leaves out is listed in labkit.costmodel's docstring (rings only, no contention,
the hierarchical sum as a pessimistic bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labkit.costmodel import _validate as check


@dataclass(frozen=True)
class Link:
    """One level of interconnect: per-step latency alpha and nccl-tests-style bus bandwidth.

    busbw is what nccl-tests reports: the per-rank link speed a ring needs, the same number
    for all_reduce, reduce_scatter and all_gather.
    """

    name: str
    alpha_s: float
    busbw_Bps: float

    def __post_init__(self):
        check.amount("Link.alpha_s", self.alpha_s, zero_ok=True)
        check.amount("Link.busbw_Bps", self.busbw_Bps)

    @classmethod
    def from_measurements(cls, name, sizes_bytes, times_s, n=2, op="all_reduce"):
        """A Link fitted (least squares) to measured collective times, e.g. the course's gloo runs."""
        alpha, busbw = fit_alpha_beta(sizes_bytes, times_s, n=n, op=op)
        return cls(name, alpha, busbw)


@dataclass(frozen=True)
class TwoLevel:
    """NVLink inside a node of `gpus_per_node`, a network across nodes.

    Assumes a rail-optimized cluster: every GPU has its own NIC, so in the network phase each
    GPU moves only its 1/gpus_per_node share of the data over its own NIC.
    """

    intra: Link
    inter: Link
    gpus_per_node: int = 8

    def __post_init__(self):
        check.instance("TwoLevel.intra", self.intra, Link)
        check.instance("TwoLevel.inter", self.inter, Link)
        check.count("TwoLevel.gpus_per_node", self.gpus_per_node)

    @property
    def name(self):
        return f"{self.intra.name} + {self.inter.name}"


# Latencies are order-of-magnitude per ring step; bandwidths are bus bandwidths.
NVLINK_H100 = Link("NVLink H100", 1e-6, 370e9)  # published: nccl-tests maintainers, ring busbw
NVLINK_A100 = Link("NVLink A100", 1e-6, 230e9)  # assumption: typical DGX A100 nccl-tests busbw
NET_EFFICIENCY = 0.9  # assumption: fraction of line rate NCCL reaches
IB_200G = Link("IB/RoCE 200 Gb/s", 5e-6, 25e9 * NET_EFFICIENCY)  # 200 Gb/s = 25 GB/s per GPU
IB_400G = Link("IB/RoCE 400 Gb/s", 5e-6, 50e9 * NET_EFFICIENCY)  # 400 Gb/s = 50 GB/s per GPU
DGX_A100_IB200 = TwoLevel(NVLINK_A100, IB_200G)
DGX_H100_IB400 = TwoLevel(NVLINK_H100, IB_400G)
# The host link (CPU offload's h2d / d2h copies): PCIe 5.0 x16, per direction. Published: the
# PCI-SIG PCIe 5.0 spec, 32 GT/s per lane x 16 lanes x 128b/130b encoding = 63 GB/s each way (the
# "64 GB/s" of GPU data sheets, e.g. NVIDIA H100 PCIe / H200). Pinned-memory copies reach about
# 80-90% of it in practice (assumption, not measured here); alpha: a copy's launch latency, ~10 us.
PCIE_GEN5_X16 = Link("PCIe Gen5 x16 (host link)", 10e-6, 32e9 * 16 * 128 / 130 / 8)


def host_copy_time(nbytes: float, link: Link = PCIE_GEN5_X16) -> float:
    """Seconds to copy `nbytes` one way between host and device over `link` (alpha + bytes / bw):
    CPU offload's per-step h2d or d2h traffic, priced."""
    check.amount("host_copy_time nbytes", nbytes, zero_ok=True)
    check.instance("host_copy_time link", link, Link)
    return link.alpha_s + nbytes / link.busbw_Bps if nbytes else 0.0


LINKS = {
    l.name: l
    for l in (DGX_A100_IB200, DGX_H100_IB400, TwoLevel(NVLINK_H100, IB_200G), NVLINK_H100, IB_200G, IB_400G)
}

# Recorded constants, not measured in this run: gloo all_reduce busbw, 2 ranks, 1 thread each, on the
# course's 2-core x86 CI machine (torch 2.13 CPU), November 2026. A notebook that shows them says so;
# dp_lab measures this machine's own figures.
GLOO_ALL_REDUCE_BUSBW_2RANKS = {64 * 2**10: 0.05e9, 2**20: 0.7e9, 16 * 2**20: 1.36e9, 64 * 2**20: 1.47e9}


def _ring_factors(op, n):
    """(latency steps, bandwidth factor) of a ring collective over n ranks."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return n - 1, (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


def fit_alpha_beta(sizes_bytes, times_s, n=2, op="all_reduce"):
    """Fit t = steps*alpha + factor*S/busbw to measurements; returns (alpha_s, busbw_Bps).

    For a ring all_reduce, steps = 2(n-1) and factor = 2(n-1)/n, so busbw here is exactly
    what nccl-tests would print. alpha is clamped at 0 (a negative latency is noise).
    """
    check.count("n", n, minimum=2)
    steps, factor = _ring_factors(op, n)
    sizes, times = np.asarray(sizes_bytes, float), np.asarray(times_s, float)
    if sizes.ndim != 1 or sizes.shape != times.shape or len(sizes) < 2:
        raise ValueError(
            f"sizes_bytes and times_s must be two equal-length lists of 2 or more, got {sizes.shape} and {times.shape}"
        )
    if not (
        np.all(np.isfinite(sizes)) and np.all(sizes > 0) and np.all(np.isfinite(times)) and np.all(times > 0)
    ):
        raise ValueError("sizes_bytes and times_s must be finite and > 0")
    design = np.stack([np.full_like(sizes, steps), factor * sizes], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, times, rcond=None)
    if alpha < 0:  # refit through the origin
        alpha, inv_bw = 0.0, float(np.sum(factor * sizes * times) / np.sum((factor * sizes) ** 2))
    return float(alpha), float(1.0 / inv_bw)


def gloo_link():
    """A Link calibrated from the course's 2-rank gloo all_reduce measurements."""
    sizes = list(GLOO_ALL_REDUCE_BUSBW_2RANKS)
    times = [s / bw for s, bw in GLOO_ALL_REDUCE_BUSBW_2RANKS.items()]  # n=2: busbw = algbw
    return Link.from_measurements(
        "gloo, 2 CPU ranks (recorded 2026-11 on a 2-core CI machine)", sizes, times, n=2
    )


def collective_time(op, n, size_bytes, link):
    """Seconds for one ring collective of `size_bytes` (the full, unsharded tensor) on n ranks."""
    _ring_factors(op, 2)  # an unknown op is refused whatever n is
    check.count("n", n)
    check.amount("size_bytes", size_bytes, zero_ok=True)
    check.instance("link", link, (Link, TwoLevel))
    if n <= 1:
        return 0.0
    if isinstance(link, TwoLevel):
        local = min(n, link.gpus_per_node)
        nodes = math.ceil(n / local)
        if nodes == 1:
            return collective_time(op, n, size_bytes, link.intra)
        share = size_bytes / local  # each GPU's slice goes over its own NIC
        if op == "all_reduce":  # reduce-scatter in node, all-reduce across, all-gather in node
            return (
                collective_time("reduce_scatter", local, size_bytes, link.intra)
                + collective_time("all_reduce", nodes, share, link.inter)
                + collective_time("all_gather", local, size_bytes, link.intra)
            )
        return collective_time(op, local, size_bytes, link.intra) + collective_time(
            op, nodes, share, link.inter
        )
    steps, factor = _ring_factors(op, n)
    return steps * link.alpha_s + factor * size_bytes / link.busbw_Bps


def inter_node_bytes(op, n, size_bytes, link):
    """Bytes each GPU sends over its NIC in `collective_time`'s collective on a TwoLevel link: 0
    inside one node; across nodes, the ring over the nodes of the GPU's slice (size / the group's
    GPUs per node), as collective_time prices it."""
    check.instance("link", link, TwoLevel)
    local = min(n, link.gpus_per_node)
    nodes = math.ceil(n / local)
    if nodes == 1:
        return 0.0
    return _ring_factors(op, nodes)[1] * size_bytes / local


def all_reduce_time(n, size_bytes, link):
    return collective_time("all_reduce", n, size_bytes, link)


def reduce_scatter_time(n, size_bytes, link):
    return collective_time("reduce_scatter", n, size_bytes, link)


def all_gather_time(n, size_bytes, link):
    return collective_time("all_gather", n, size_bytes, link)
