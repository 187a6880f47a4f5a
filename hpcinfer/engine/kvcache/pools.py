"""The paged KV cache: K and V pools allocated once, in fixed-size blocks, for every layer.

Pool layout (per layer, K and V alike): [num_blocks, block_size, kv_heads, head_dim]; token i
of a sequence is at block `block_table[i // block_size]`, offset `i % block_size`, i.e. flat slot
`block * block_size + offset`. Nothing here is allocated after start-up; `block_manager.py` says
which blocks are free.

A model with both sliding-window and full layers (Gemma 2 and 3, gpt-oss) may page its windows
(`KVLayout.paged_windows`): a block then holds as many layers as the model has full layers; the
full layers read a sequence's `block_table`, and the sliding-window layers, taken that many at a
time, each group its own table (`Sequence.local_tables`) of blocks from the same pool, which are
freed once every window has passed them (windowed_blocks.py). As in vLLM's hybrid allocator, one
pool serves both, so no split of memory between them has to be guessed at start-up.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...device import accelerators
from ...errors import ConfigError
from ...models.decoder_config import DecoderConfig

CPU_DEFAULT_BYTES = 1 << 30  # on CPU the pool defaults to 1 GiB (pages are touched only when used)
CUDA_DEFAULT_FRACTION = 0.85  # of the memory free after the model loads, leaving room for activations
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_kv_memory(text: str | None) -> int | float | None:
    """'2GiB', '512MiB', '1000000' -> bytes; '0.5' (a fraction of free device memory) -> 0.5; None -> None."""
    if text is None or text == "":
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise ConfigError(f"--kv-cache-memory: cannot read {text!r} (e.g. 2GiB, 512MiB, or 0.8 of free memory)")
    value = float(m[1])
    if not m[2] and value < 1:
        return value
    return int(value * _UNITS[m[2].lower()])


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def kv_storage(name: str) -> torch.dtype | None:
    """--kv-cache-dtype -> the pools' storage dtype (None: the run's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {name!r})")
    return KV_CACHE_DTYPES[name]


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # what attention computes in (the run's dtype)
    storage: torch.dtype | None = None  # what the pools hold, when not `dtype` (float8_e4m3fn)
    # how layers read the pools: each layer's sliding window (0: every key), when some layers have
    # one, a soft cap on the attention scores (Gemma 2), per-head sinks (gpt-oss)
    windows: tuple[int, ...] = ()
    softcap: float | None = None
    sinks: bool = False  # gpt-oss: a learned sink logit per head
    # the sliding-window layers' blocks are their own, freed behind the window (module docstring)
    paged_windows: bool = False

    @classmethod
    def of(
        cls,
        cfg: DecoderConfig,
        block_size: int,
        dtype: torch.dtype,
        storage: torch.dtype | None = None,
        page_windows: bool = False,
    ) -> KVLayout:
        """`page_windows`: free what falls out of the windows, where the model's layers allow (`can_page_windows`)."""
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype, storage)
        paged = page_windows and can_page_windows(cfg.layer_windows)
        return cls(*shape, cfg.layer_windows, cfg.attn_softcap, cfg.attn_sinks, paged)

    @property
    def window(self) -> int:
        """The sliding-window layers' window (one for all of them: `can_page_windows`), 0: none."""
        return max(self.windows, default=0)

    @property
    def block_layers(self) -> int:
        """Layers a block holds: every layer, or with paged windows the full layers' count."""
        return sum(w == 0 for w in self.windows) if self.paged_windows else self.num_layers

    @property
    def local_groups(self) -> int:
        """With paged windows, the sliding-window layers' tables: `block_layers` of them to a table."""
        if not self.paged_windows:
            return 0
        return -(-sum(w > 0 for w in self.windows) // self.block_layers)

    @property
    def places(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (index in the pool, table): table -1 is `block_table`, j >= 0 `local_tables[j]`."""
        if not self.paged_windows:
            return tuple((layer, -1) for layer in range(self.num_layers))
        full = local = 0
        out = []
        for w in self.windows:
            if w == 0:
                out.append((full, -1))
                full += 1
            else:
                out.append((local % self.block_layers, local // self.block_layers))
                local += 1
        return tuple(out)

    @property
    def stored(self) -> torch.dtype:
        return self.storage or self.dtype

    @property
    def quantized(self) -> bool:
        return self.stored != self.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.stored).element_size()
        return 2 * self.block_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def can_page_windows(windows: tuple[int, ...]) -> bool:
    """Whether sliding-window layers can have blocks of their own: some layers slide and some see
    every key, and the sliding ones share one window (true of Gemma 2 and 3 and gpt-oss)."""
    return 0 in windows and len(set(windows) - {0}) == 1


def size_pool(
    layout: KVLayout,
    memory: int | float | None,
    device: torch.device,
    reserve: Callable[[int], int] | None = None,
) -> int:
    """Number of blocks: `memory` bytes, or a fraction of free CUDA memory, or the CPU default.

    `reserve(blocks)` is memory that must stay free beside a pool of that many blocks (the decode
    graphs' peak, which grows with the pool: decode_graphs.graph_peak). A fraction (or the CUDA
    default) is a budget for the pool and that reserve together; given bytes are the pool's alone.
    """
    budgeted = isinstance(memory, float) or (memory is None and device.type == "cuda")
    if budgeted:
        if device.type != "cuda":
            raise ConfigError("--kv-cache-memory as a fraction needs a CUDA device; give bytes (e.g. 2GiB)")
        memory = int(accelerators.free_bytes(device) * (memory if isinstance(memory, float) else CUDA_DEFAULT_FRACTION))
    budget = CPU_DEFAULT_BYTES if memory is None else memory
    blocks = budget // layout.bytes_per_block
    if budgeted and reserve is not None:
        blocks = _fit_with_reserve(layout.bytes_per_block, budget, reserve)
    if blocks < 1:
        raise ConfigError(f"--kv-cache-memory {budget} bytes holds no block of {layout.bytes_per_block} bytes")
    return int(blocks)


def _fit_with_reserve(bytes_per_block: int, budget: int, reserve: Callable[[int], int]) -> int:
    """The most blocks n with n * bytes_per_block + reserve(n) <= budget (reserve grows with n)."""
    lo, hi = 0, budget // bytes_per_block
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * bytes_per_block + reserve(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On the CPU an anonymous mapping of its own: the kernel hands out zero pages as
    they are first touched, so a pool sized for the longest job costs neither the time to clear it
    (0.2 s a GiB) nor resident memory for blocks a short job never uses.

    NOTE: not numpy's zeros, which asks for transparent huge pages on arrays over 4 MiB: a first
    touch then faults in 2 MiB at once, and on a virtual machine whose host takes back the guest's
    free memory (free page reporting, as Firecracker's) each such fault cost 20-50 ms of system time:
    a decode run's steps took 1.18x as long (benchmarks/speed/bench_kv_pages.py).
    Where the system gives every mapping huge pages (THP `always`) this one gets them too.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    # anonymous and private (Python's default is shared: shmem, whose pages a forked child would write)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # NOTE: Windows has none
    mapping = mmap.mmap(-1, max(nbytes, 1), **private)  # zero pages until written
    # NOTE: the tensor holds a reference to the mapping, which is unmapped when the tensor goes
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    """The pools: `keys(layer)`, `values(layer)` are [num_blocks, block_size, kv_heads, head_dim].

    An FP8 cache (`layout.storage` float8_e4m3fn) holds K and V divided by a scale per layer and
    clamped to e4m3's range; `raw` gives its pools as bytes for copies and gathers (which torch
    does not run on float8 tensors on the CPU) and `dequantize` turns gathered blocks back into
    the run's dtype. The scales are 1.0, as in engines without calibrated scales: e4m3 keeps about
    two significant digits from 0.016 to 448, the range of K and V in the models measured.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        # each layer's index in the pools and the table it reads (-1: `block_table`; paged windows: j)
        self.places = layout.places
        shape = (layout.block_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # NOTE: zeroed, not empty: padded reads of unused slots are masked to weight 0, and 0 * NaN
        # from uninitialised memory would still poison the output.
        self.k = zeroed(shape, layout.stored, device)
        self.v = zeroed(shape, layout.stored, device)
        self.k_scale = [1.0] * layout.num_layers
        self.v_scale = [1.0] * layout.num_layers
        # Flat [slots, kv_heads, head_dim] views for writing this step's K/V by slot.
        self.k_slots = self.k.view(layout.block_layers, -1, layout.num_kv_heads, layout.head_dim)
        self.v_slots = self.v.view(layout.block_layers, -1, layout.num_kv_heads, layout.head_dim)
        # Tensor parallelism (rank 0): the block copies made since the last step, which the other
        # ranks make in their own pools before that step's forward. None: not recorded.
        self.copied: list[tuple[int, int]] | None = None
        self.writer: Any = None  # the block manager handing out this pool's blocks (its high_water)
        self.stepping = 0  # engine steps running in this pool now

    def clear_written(self) -> None:
        """A pool kept from an earlier engine (a server's earlier batch): the blocks that engine
        wrote zeroed again, the rest never touched. Its K/V are finite numbers that masked reads
        weigh 0, but a NaN among them would still poison them; and the untouched pages stay unpaged."""
        if self.writer is not None:
            written = self.writer.high_water
            self.k[:, :written].zero_()
            self.v[:, :written].zero_()
        self.writer = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of block `src` copied into block `dst`, every layer, for each (src, dst): a forked
        sequence's own copy of its parent's last, partly filled block (copy-on-write)."""
        if self.copied is not None:
            self.copied.extend(pairs)
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    def keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K pool [num_blocks, block_size, kv_heads, head_dim]."""
        return self.k[self.places[layer][0]]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[self.places[layer][0]]

    def table(self, layer: int) -> int:
        """The table layer `layer` reads: -1 a sequence's `block_table`, j its `local_tables[j]`."""
        return self.places[layer][1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into the flat slots [T] (of the table the layer reads)."""
        if self.layout.quantized:
            k, v = self._quantize(k, self.k_scale[layer]), self._quantize(v, self.v_scale[layer])
        index = self.places[layer][0]
        self.raw(self.k_slots[index]).index_copy_(0, slots, self.raw(k))
        self.raw(self.v_slots[index]).index_copy_(0, slots, self.raw(v))

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(self.layout.stored)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """A stored tensor as bytes (FP8), or itself: copies and gathers go through this."""
        return x.view(torch.uint8) if self.layout.quantized else x

    def dequantize(self, gathered: torch.Tensor, layer: int, key: bool) -> torch.Tensor:
        """Blocks gathered through `raw` -> the run's dtype (the same tensor when not quantized)."""
        if not self.layout.quantized:
            return gathered
        scale = self.k_scale[layer] if key else self.v_scale[layer]
        return gathered.view(self.layout.stored).to(self.layout.dtype).mul_(scale)
