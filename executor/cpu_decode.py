"""The CPU decode kernel: decode steps of a few rows through every layer in one C call.

A decode step of one to eight sequences on CPU streams every weight once and is bound by memory
bandwidth; the matmuls cannot be faster than that, but in Python each layer also dispatches some
60 small torch ops, and each, right after a matmul has streamed megabytes through the caches,
runs with the interpreter's and the dispatcher's working set evicted. `cpu_decode.c` does a
dense decoder's layers (norms, QKV, q/k norms, rotary, the paged K/V write, attention, output
projection, gated SiLU MLP) for up to `max_rows` rows with its own matrix-vector kernel, which
reads each weight row once for all rows, on the process's OpenMP team (the C library's
``libgomp.so.1`` is the one torch has loaded).

It is built when the executor loads, with the machine's C compiler (``$CC``, else ``cc``) and
``-march=native``, into a temporary file that is loaded and deleted: nothing is cached between
machines. No compiler, a failed build, a model it does not cover (`eligible`), or too little
memory for its copy of the weights (it needs them in the checkpoint layout next to oneDNN's packed
ones) leaves the executor on the torch path, and the log says why. The kernel computes what the
torch path computes in another summation order (greedy tokens match; logits agree to ~1e-5).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from executor.attention_metadata import AttentionMetadata
from executor.layers.linear import Linear
from executor.layers.mlp import DenseMLP

if TYPE_CHECKING:
    from executor.models.decoder import CausalLM

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
# The most of the available memory the kernel's copy of the weights may take ("auto").
MAX_MEMORY_SHARE = 0.25

_P = ctypes.POINTER(ctypes.c_float)


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "in_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "q_norm",
            "k_norm",
            "o",
            "o_bias",
            "gate_up",
            "gate_up_bias",
            "down",
            "down_bias",
            "k_cache",
            "v_cache",
        )
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in ("hidden", "heads", "kv_heads", "head_dim", "rot_dim", "inter", "block_size", "num_layers")
        ],
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
    ]


def _ptr(t: torch.Tensor | None) -> Any:
    """A ``float *`` to ``t``'s data (NULL for None)."""
    return None if t is None else ctypes.cast(t.data_ptr(), _P)


def eligible(model: CausalLM) -> str | None:
    """Why the kernel cannot run ``model`` (None: it can): it covers dense decoders in fp32 on CPU
    with plain RMSNorm, optional q/k norm and biases, full causal attention and a SiLU-gated MLP,
    without tensor parallelism."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not fp32 on CPU"
    if model.tp is not None:
        return "tensor parallel"
    if model.embed_scale is not None:
        return "scaled embeddings"
    if model.cfg.final_softcap is not None or model.norm.fp32_scale:
        return "a soft-capped or fp32-scaled head"
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
            return "sandwich norms"
        if not isinstance(mlp, DenseMLP) or mlp.act is not model.ops.silu_and_mul:
            return "not a SiLU-gated dense MLP"
        if attn.extra:
            return f"attention with {', '.join(sorted(attn.extra))}"
        if (attn.q_norm is None) != (attn.k_norm is None):
            return "a q norm without a k norm"
        norms = [layer.in_norm, layer.post_norm, *(n for n in (attn.q_norm, attn.k_norm) if n is not None)]
        if any(n.fp32_scale for n in norms):
            return "norms scaled in fp32"
        if attn.hq % attn.hkv or attn.hq // attn.hkv > 64 or attn.cos_sin.shape[1] > attn.d or attn.cos_sin.shape[1] % 2:
            return "unsupported head layout"
        if attn.cos_sin is not model.layers[0].attn.cos_sin:
            return "layers with different rotary tables"
    return None


def _shape(linear: Linear) -> torch.Size:
    return linear.weight.shape if linear.weight is not None else linear.packed.shape  # type: ignore[union-attr]


def _plain(linear: Linear) -> torch.Tensor:
    """The weight in the checkpoint layout ``[out, in]`` (unpacked from oneDNN's copy if needed)."""
    if linear.weight is not None:
        return linear.weight
    assert linear.packed is not None
    return linear.packed.to_dense()


def panels(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernel's layout: ``[P, K, r]``, panel ``p`` holding rows
    ``p r .. p r + r - 1`` interleaved, N padded with zero rows to a whole group of panels
    (``r`` and the group: `cpu_decode.c`'s ``VEC`` and ``PANEL_GROUP``)."""
    rows, group = int(lib.conveyor_panel_rows()), int(lib.conveyor_panel_group())
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, 0, 0, -n % group))
    return padded.view(-1, rows, k).transpose(1, 2).contiguous()


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _openmp_runtimes() -> set[str]:
    """The OpenMP libraries mapped into this process (none known where /proc is not)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libomp", "libiomp")
    return {line.split()[-1] for line in maps.splitlines() if "/" in line and any(n in line for n in names)}


def build_library() -> ctypes.CDLL | str:
    """Compile and load `cpu_decode.c`; on failure, why (a string)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    with tempfile.TemporaryDirectory(prefix="conveyor-cpu-decode-") as tmp:
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
        out = Path(tmp) / f"cpu_decode_{digest}.so"
        try:
            proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{cc} failed: {e}"
        if proc.returncode != 0:
            return f"{cc} failed: {proc.stderr.strip()[-500:]}"
        try:
            lib = ctypes.CDLL(str(out))  # stays mapped after the file is deleted
        except OSError as e:
            return f"loading the kernel failed: {e}"
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:  # two thread pools would each take every core
        return f"its OpenMP runtime is not torch's ({', '.join(sorted(runtimes))})"
    lib.conveyor_decode.restype = ctypes.c_int
    lib.conveyor_decode.argtypes = [
        ctypes.POINTER(_Dims),
        ctypes.POINTER(_Layer),
        ctypes.c_int64,
        _P,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
        _P,
        _P,
        _P,
        _P,
        ctypes.c_int64,
        _P,
        ctypes.c_int,
    ]
    lib.conveyor_work_floats.restype = ctypes.c_int64
    lib.conveyor_work_floats.argtypes = [ctypes.POINTER(_Dims), ctypes.c_int64, ctypes.c_int64]
    for name in ("conveyor_max_rows", "conveyor_panel_rows", "conveyor_panel_group"):
        getattr(lib, name).restype = ctypes.c_int
    lib.conveyor_logits.restype = ctypes.c_int
    lib.conveyor_logits.argtypes = [ctypes.POINTER(_Dims), _P, _P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, ctypes.c_int]
    lib.conveyor_linear.restype = ctypes.c_int
    lib.conveyor_linear.argtypes = [_P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


class CpuDecodeKernel:
    """Runs decode-only steps of up to `max_rows` rows of ``model`` through `cpu_decode.c`, and
    the model's head (`logits`) for up to as many rows.

    Holds the layers' weights in the checkpoint layout (a second copy beside oneDNN's packed one)
    and a table of their and the KV caches' addresses, so a step passes a few pointers. `run`
    returns None for a step it does not take; the caller runs the torch path then.
    """

    __slots__ = ("lib", "model", "max_rows", "dims", "layers", "_keep", "_rope", "_work", "_norm", "_head", "_vocab", "_last")

    def __init__(self, lib: ctypes.CDLL, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.lib, self.model = lib, model
        self.max_rows = int(lib.conveyor_max_rows())
        first = model.layers[0]
        attn = first.attn
        assert isinstance(first.mlp, DenseMLP)
        self.dims = _Dims(
            hidden=model.cfg.hidden_size,
            heads=attn.hq,
            kv_heads=attn.hkv,
            head_dim=attn.d,
            rot_dim=attn.cos_sin.shape[1],
            inter=_shape(first.mlp.down)[1],
            block_size=kv_caches[0][0].shape[1],
            num_layers=len(model.layers),
            eps=first.in_norm.eps,
            scale=attn.scale,
        )
        self._keep: list[torch.Tensor] = []  # every tensor the table points into
        self._rope = attn.cos_sin.contiguous()
        layers = (_Layer * len(model.layers))()
        for entry, layer, (k_cache, v_cache) in zip(layers, model.layers, kv_caches):
            a, m = layer.attn, layer.mlp
            assert isinstance(m, DenseMLP)
            tensors = {
                "in_norm": layer.in_norm.weight,
                "post_norm": layer.post_norm.weight,
                "qkv": panels(lib, _plain(a.qkv)),
                "qkv_bias": a.qkv.bias,
                "q_norm": None if a.q_norm is None else a.q_norm.weight,
                "k_norm": None if a.k_norm is None else a.k_norm.weight,
                "o": panels(lib, _plain(a.o)),
                "o_bias": a.o.bias,
                "gate_up": panels(lib, _plain(m.gate_up)),
                "gate_up_bias": m.gate_up.bias,
                "down": panels(lib, _plain(m.down)),
                "down_bias": m.down.bias,
                "k_cache": k_cache,
                "v_cache": v_cache,
            }
            for name, t in tensors.items():
                if t is not None:
                    t = t.contiguous()
                    assert t.dtype == torch.float32 and t.device.type == "cpu", name
                    self._keep.append(t)
                setattr(entry, name, _ptr(t))
        self.layers = layers
        self._work = torch.empty(0)
        self._norm, self._head = model.norm.weight.contiguous(), panels(lib, _plain(model.lm_head))
        self._vocab = _shape(model.lm_head)[0]
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # `run`'s hidden states and their logits

    @staticmethod
    def weight_bytes(model: CausalLM) -> int:
        """Bytes of the copy of the weights the kernel keeps."""
        total = 0
        for layer in model.layers:
            mlp = layer.mlp
            assert isinstance(mlp, DenseMLP)
            for lin in (layer.attn.qkv, layer.attn.o, mlp.gate_up, mlp.down):
                shape = _shape(lin)
                total += shape[0] * shape[1] * 4
        return total + model.cfg.vocab_size * model.cfg.hidden_size * 4  # the head

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, head: bool = True
    ) -> torch.Tensor | None:
        """The hidden states ``[rows, hidden]`` of a decode-only step of at most `max_rows` rows
        (the K/V of its tokens written to the cache), or None for any other step. With ``head``
        (every row is sampled), their logits too, in the same call: `logits` returns them."""
        rows = meta.num_seqs
        if rows > self.max_rows or meta.per_layer is not None or input_ids.shape[0] != rows:
            return None
        if any(q != 1 for q in meta.query_lens_list):
            return None
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        if bool((slots < 0).any()):
            return None
        h = torch.nn.functional.embedding(input_ids, self.model.embed).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        ctx = torch.tensor(meta.seq_lens_list, dtype=torch.int64)
        pos = positions.to(torch.int64).contiguous()
        vocab = self._vocab
        logits = torch.empty(rows, vocab, dtype=torch.float32) if head else None
        need = int(self.lib.conveyor_work_floats(ctypes.byref(self.dims), rows, max(meta.seq_lens_list)))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        rc = self.lib.conveyor_decode(
            ctypes.byref(self.dims),
            self.layers,
            rows,
            _ptr(h),
            ctypes.cast(tables.data_ptr(), ctypes.POINTER(ctypes.c_int32)),
            tables.shape[1],
            ctypes.cast(slots.data_ptr(), ctypes.POINTER(ctypes.c_int64)),
            ctypes.cast(pos.data_ptr(), ctypes.POINTER(ctypes.c_int64)),
            ctypes.cast(ctx.data_ptr(), ctypes.POINTER(ctypes.c_int64)),
            _ptr(self._rope),
            _ptr(self._work),
            _ptr(self._norm),
            _ptr(self._head),
            vocab,
            _ptr(logits),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"cpu decode kernel failed ({rc})")
        self._last = None if logits is None else (h, logits)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`CausalLM.compute_logits` of at most `max_rows` rows (None for more); of the hidden
        states `run` returned last, what it computed with them."""
        last, self._last = self._last, None
        if last is not None and last[0] is hidden:
            return last[1]
        rows = hidden.shape[0]
        if not 1 <= rows <= self.max_rows:
            return None
        hidden = hidden.contiguous()
        normed = torch.empty_like(hidden)
        vocab = self._vocab
        out = torch.empty(rows, vocab, dtype=torch.float32)
        rc = self.lib.conveyor_logits(
            ctypes.byref(self.dims),
            _ptr(self._norm),
            _ptr(self._head),
            vocab,
            rows,
            _ptr(hidden),
            _ptr(normed),
            _ptr(out),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"cpu decode kernel failed ({rc})")
        return out


def make_cpu_decode_kernel(
    mode: str, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], unsupported: str | None = None
) -> CpuDecodeKernel | None:
    """The kernel for ``model`` when ``mode`` (`ModelConfig.cpu_decode_kernel`) is "auto" and it
    can run (``unsupported``: the executor's reason why not); else None, and the log says why."""
    if mode == "off":
        return None
    why = unsupported or eligible(model)
    if why is None:
        need, available = CpuDecodeKernel.weight_bytes(model), _available_memory()
        if available is not None and need > MAX_MEMORY_SHARE * available:
            why = f"its copy of the weights ({need / 2**30:.1f} GiB) exceeds {MAX_MEMORY_SHARE:.0%} of the available memory"
    if why is None:
        lib = build_library()
        if isinstance(lib, str):
            why = lib
        else:
            kernel = CpuDecodeKernel(lib, model, kv_caches)
            logger.info("cpu decode kernel on: decode steps of up to %d rows run in C", kernel.max_rows)
            return kernel
    logger.info("cpu decode kernel off: %s", why)
    return None
