"""Per-card memory of one training setting, part by part, from what autograd keeps between forward and backward.

Counted per rank (one process per card):

- weights: as loaded (``Workload.weight_bytes``): float32 master weights under --bf16 autocast or none, bf16 where
  the run loads them in bf16 (a bf16 checkpoint as transformers 5 loads it, ``--torch_dtype bfloat16``), which it
  then trains in bf16; plus fp8 copies of the linear weights with --fp8;
- gradients: one per weight, in its dtype;
- optimizer state: AdamW's two moments, in the weights' dtype (torch's AdamW makes them ``zeros_like`` the
  parameter);
- activations: what each decoder layer saves for its backward, per token (``layer_activation_bytes``), for the
  tokens this rank holds (micro-batch x sequence / context-parallel degree); with gradient checkpointing only
  each layer's input, plus one layer recomputed; under bf16 autocast also the bf16 casts of the linear weights
  each matmul saves (``weight_cast_bytes``); with bf16 weights the residual stream is bf16 and no weight is cast;
- logits/loss: the [tokens, vocabulary] logits, their float32 log-softmax and its gradient; with the fused loss
  only one chunk of them and the output layer's gradient, computed in the forward;
- communication buffers: DDP's gradient buckets (a Gaudi's gradients are views into them) and on a CPU gloo's
  working copy of one bucket (held only while a bucket is reduced, with the gradients, never with the loss's
  tensors), fast_ddp's fused buffer, FSDP's gathered layers;
- workspace: on a CPU, what a training process holds beyond the tensors: a fixed part (math libraries' buffers,
  the loop's state) and the heap's kept blocks, a share of the activations and loss tensors the backward frees,
  both fitted on this machine; on a card it is part of the reserve;
- runtime reserve: the runtime's own memory (an assumption, settings.Assumptions).

With LoRA adapters on a frozen model (``Workload.adapters``) the weights are the frozen ones as loaded (float32 or
bf16) plus the float32 adapters, and gradients, optimizer state and gradient buffers are the adapters' alone; the
activations are what the backward needs to reach the adapters through the frozen layers (``frozen_layer_bytes``).

Peak: gradients are freed before each step (Trainer's ``zero_grad(set_to_none=True)``), so with one micro-batch
a step and gradients that are not bucket views the activations and the full gradients never live together: the
peak is the larger of the backward's start (activations, logits, the output layer's gradient) and its end (all
gradients, and gloo's working copy of the bucket being reduced). With accumulation, or gradients living in DDP's
buckets, they add up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .hardware import GB, Card
from .model import ModelShape
from .settings import Adapters, Assumptions, Setting, Workload

FP32 = 4
DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb, which the CPU device keeps (devices/cpu.py)
CHUNK_ELEMENTS = 1 << 26  # the fused loss's logits chunk (features/linear_cross_entropy.py's CHUNK_ELEMENTS)


@dataclass(frozen=True)
class Breakdown:
    """Bytes per card, part by part; ``peak`` is what must fit (see the module docstring for how parts overlap)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    communication: float
    workspace: float
    reserve: float
    peak: float

    def parts(self) -> dict[str, float]:
        return {
            "weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
            "activations": self.activations, "logits/loss": self.logits, "comm buffers": self.communication,
            "workspace": self.workspace, "reserve": self.reserve,
        }  # fmt: skip

    @property
    def training(self) -> float:
        """The peak less the runtime's reserve: what the training itself holds (measured on CPU as peak RSS less
        the process's resident set before the model was built)."""
        return self.peak - self.reserve


def low_precision_weights(workload: Workload) -> bool:
    """Full fine-tuning of weights loaded in bf16 (or fp16): they train in that dtype, no float32 master copy."""
    return workload.adapters is None and workload.weight_bytes != FP32


def loaded_bytes(workload: Workload) -> int:
    """Bytes of a model weight as loaded: the trained ones in full fine-tuning, the frozen ones beside adapters."""
    return workload.weight_bytes if workload.adapters is None else workload.adapters.frozen_bytes


def trained_bytes(workload: Workload) -> int:
    """Bytes of a trained parameter, and so of its gradient and of each AdamW moment: the weights' own dtype in full
    fine-tuning, float32 for adapters (PEFT's ``autocast_adapter_dtype``)."""
    return workload.weight_bytes if workload.adapters is None else FP32


def _element_bytes(workload: Workload, setting: Setting) -> tuple[int, int]:
    """(bytes of a saved matmul output, bytes of a saved linear input): bf16 autocast saves its casts in bf16, bf16
    weights compute in bf16, fp8 saves the linear layers' inputs in fp8."""
    if workload.precision == "fp32" and not low_precision_weights(workload):
        return FP32, FP32
    return 2, 1 if setting.fp8 else 2


def _norm_bytes(shape: ModelShape, workload: Workload) -> float:
    """What one norm of a fully trained model saves per token besides its output: GPT-2's LayerNorm its input (the
    residual stream's dtype, the weights'); Llama's RMSNorm its float32 input (a cast of a bf16 one) and the
    normalised value in the weights' dtype, which its weight multiplies."""
    residual = 2 if low_precision_weights(workload) else FP32
    return (residual if shape.family == "gpt2" else FP32 + residual) * shape.hidden


def adapter_layer_parameters(shape: ModelShape, adapters: Adapters) -> int:
    """One decoder layer's adapter parameters: rank x (inputs + outputs) for each adapted linear layer."""
    targets = shape.lora_targets(adapters.targets)
    return sum(adapters.rank * (i + o) for group in shape.linear_groups() for name, i, o in group if name in targets)


def adapter_parameters(shape: ModelShape, adapters: Adapters) -> int:
    """All the adapters' parameters (the output layer's too where ``lm_head`` is adapted): what a LoRA run trains."""
    head = adapters.rank * (shape.hidden + shape.vocab) if "lm_head" in shape.lora_targets(adapters.targets) else 0
    return shape.layers * adapter_layer_parameters(shape, adapters) + head


def trained_parameters(shape: ModelShape, workload: Workload) -> int:
    """The parameters that get gradients and optimizer state: all of them, or the adapters'."""
    return shape.parameters() if workload.adapters is None else adapter_parameters(shape, workload.adapters)


def _adapter_activation_bytes(
    shape: ModelShape, workload: Workload, adapters: Adapters, groups: tuple[tuple[tuple[str, int, int], ...], ...]
) -> float:
    """Per token, what the adapters on ``groups`` (linear layers by shared input) keep: each its input in its own
    dtype (float32, bf16 under autocast: a cast each; one input for the group where nothing casts or drops it), its
    dropout mask (float32: a CPU's dropout multiplies by a mask of the input's dtype; a Gaudi's may keep bytes) and
    the rank-wide output of its first matrix."""
    targets = shape.lora_targets(adapters.targets)
    autocast = workload.precision == "bf16"
    element = 2 if autocast else FP32
    shared = not (adapters.dropout or autocast or adapters.frozen_bytes != FP32)
    total = 0.0
    for group in groups:
        widths = [i for name, i, _ in group if name in targets]
        if widths:
            total += (1 if shared else len(widths)) * element * widths[0] + element * adapters.rank * len(widths)
            total += FP32 * sum(widths) if adapters.dropout else 0
    return total


def frozen_layer_bytes(shape: ModelShape, workload: Workload, adapters: Adapters) -> float:
    """Bytes one decoder layer of a frozen model with LoRA adapters saves for its backward, per token. A frozen
    linear layer keeps no input (its weight gets no gradient), a norm with frozen weights only its input (float32 in
    Llama's RMSNorm, the residual stream's dtype in GPT-2's LayerNorm); what the backward differentiates through is
    kept as in full fine-tuning (q, k, v and SDPA's output; the MLP's gate, up and SiLU outputs, GPT-2's gelu_new),
    in bf16 under autocast or with bf16 weights; then the adapters' own (``_adapter_activation_bytes``)."""
    out = 2 if workload.precision == "bf16" or adapters.frozen_bytes == 2 else FP32
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    if shape.family == "gpt2":
        kept = 2 * (FP32 if adapters.frozen_bytes == FP32 else 2) * h + out * 3 * h + out * h + out * 4 * i
    else:
        kept = 2 * FP32 * h + out * (q + 2 * kv) + out * q + out * 3 * i
    return kept + _adapter_activation_bytes(shape, workload, adapters, shape.linear_groups())


def layer_activation_bytes(shape: ModelShape, workload: Workload, setting: Setting) -> float:
    """Bytes one decoder layer saves for its backward, per token. The residual stream and the norms stay in float32
    (float32 weights); under autocast every linear layer saves its own low-precision cast of its input, so a norm
    feeding three projections saves three casts, where float32 training saves the norm's output once. With bf16
    weights everything is bf16 but RMSNorm's float32 input, and the norm's output is saved once (autocast's cast of
    a bf16 tensor is the tensor)."""
    if workload.adapters is not None:
        return frozen_layer_bytes(shape, workload, workload.adapters)
    out, lin = _element_bytes(workload, setting)
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    fp32 = out == FP32
    shared = fp32 or (low_precision_weights(workload) and not setting.fp8)  # one tensor every projection reads

    def norm_output(consumers: int) -> float:  # the normalised input a linear layer saves
        return lin * h if shared else consumers * lin * h

    own_copy = lin if setting.fp8 else 0  # an fp8 linear layer saves its own cast; others save SDPA's output itself
    if shape.family == "gpt2":
        # LayerNorm saves its input; c_attn's input, q/k/v (one tensor), SDPA's output (a view feeds c_proj); ln_2,
        # c_fc's input, then GPT-2's gelu_new, written out in Python: its input, tanh's output, 1 + tanh,
        # input / 2, and the product c_proj saves (dropout not counted: a byte-per-element mask where it is on)
        norm = _norm_bytes(shape, workload)
        attention = norm + norm_output(1) + out * 3 * h + out * h + own_copy * h
        mlp = norm + norm_output(1) + out * 4 * i + lin * i
        return attention + mlp
    # Llama-like: RMSNorm saves its float32 input and normalised value; q/k/v's inputs, rotated q and k, v, SDPA's
    # output; norm, gate/up inputs, gate and up outputs, SiLU(gate), down_proj's input
    norm = _norm_bytes(shape, workload)
    attention = norm + norm_output(3) + out * (q + 2 * kv) + out * q + own_copy * q
    mlp = norm + norm_output(2) + out * 3 * i + lin * i
    return attention + mlp


def tokens_per_rank(workload: Workload, setting: Setting) -> int:
    return setting.micro_batch * workload.sequence // setting.context_parallel


def activation_bytes(shape: ModelShape, workload: Workload, setting: Setting) -> float:
    """Everything the layers and the final norm save for the backward on one rank."""
    tokens = tokens_per_rank(workload, setting)
    layer = layer_activation_bytes(shape, workload, setting)
    adapters = workload.adapters
    if adapters is not None:  # the final norm's input; the frozen output layer keeps none, an adapter on it its own
        residual = FP32 if adapters.frozen_bytes == FP32 else 2
        final_norm = (FP32 if shape.family == "gated" else residual) * shape.hidden
        final_norm += _adapter_activation_bytes(shape, workload, adapters, ((("lm_head", shape.hidden, shape.vocab),),))
        if setting.checkpointing:  # each layer's input kept in the residual stream's dtype
            return tokens * (shape.layers * residual * shape.hidden + layer + final_norm)
        return tokens * (shape.layers * layer + final_norm)
    _, lin = _element_bytes(workload, setting)
    final_norm = _norm_bytes(shape, workload) + lin * shape.hidden  # and its output, which the output layer saves
    if setting.checkpointing:  # each layer's input kept (the weights' dtype), one layer recomputed at a time
        residual = 2 if low_precision_weights(workload) else FP32
        return tokens * (shape.layers * residual * shape.hidden + layer + final_norm)
    return tokens * (shape.layers * layer + final_norm)


def weight_cast_bytes(shape: ModelShape, workload: Workload, setting: Setting) -> float:
    """The low-precision casts of the linear weights autograd saves for the backward under bf16 autocast (a matmul's
    backward needs the weight it multiplied by, and under autocast that is the cast, not the float32 master).

    None in float32; none for weights loaded in bf16 (the cast is the weight); none under FSDP, whose bf16
    all-gather hands the layers weights that are its own gathered units (counted with the communication buffers);
    fp8 layers keep their own copies (counted with the weights).
    With checkpointing only the recomputed layer's casts and the output layer's live at once; the fused loss
    computes the output layer's gradient in the forward and saves no cast of it."""
    if workload.precision == "fp32" or setting.strategy == "fsdp" or low_precision_weights(workload):
        return 0.0
    low = 2
    layers = 0 if setting.fp8 else (1 if setting.checkpointing else shape.layers)
    linear = shape.layer_parameters() - shape.layer_norm_and_bias_parameters()
    head = 0 if setting.fused_loss else shape.vocab * shape.hidden
    adapters = workload.adapters
    if adapters is not None:  # frozen weights loaded in bf16 need no cast; the adapters' casts are saved too
        frozen = adapters.frozen_bytes == FP32
        head_adapter = adapter_parameters(shape, adapters) - shape.layers * adapter_layer_parameters(shape, adapters)
        linear = linear * frozen + adapter_layer_parameters(shape, adapters)
        head = head * frozen + head_adapter
    return low * (layers * linear + head)


def logits_bytes(shape: ModelShape, workload: Workload, setting: Setting) -> float:
    """The loss's peak: full logits, or one chunk of them and the output layer's float32 gradient (fused)."""
    tokens = tokens_per_rank(workload, setting)
    if setting.fused_loss:
        out, _ = _element_bytes(workload, setting)
        chunk = min(tokens, max(1, CHUNK_ELEMENTS // shape.vocab))
        # the float32 logits buffer, its gradient's cast to the compute dtype (none in float32: the buffer itself),
        # the hidden states' gradient, the head's float32 gradient
        cast = 0 if out == FP32 else out
        head_gradient = FP32 * shape.vocab * shape.hidden if workload.adapters is None else 0  # none: a frozen head
        return chunk * shape.vocab * (FP32 + cast) + tokens * shape.hidden * out + head_gradient
    # at the start of the backward: float32 log-softmax output, its incoming gradient and the gradient it makes
    return tokens * shape.vocab * 3 * FP32


def _communication_bytes(
    shape: ModelShape, workload: Workload, setting: Setting, card: Card, trained: int, bucket_views: bool
) -> tuple[float, float]:
    """(communication buffers, the part of them held only while gradients are reduced): by strategy and card."""
    adapters = workload.adapters
    world = workload.world
    element = trained_bytes(workload)
    communication = 0.0
    reducing = 0.0  # held only while gradients are reduced: by then the loss's tensors and most activations are freed
    if world > 1 and setting.strategy == "ddp" and not bucket_views:
        communication = element * trained  # DDP's buckets (the gradients' dtype), beside the gradients
        if card.kind == "cpu":  # gloo reduces through a working copy of a bucket (HCCL and NCCL on the card)
            reducing = min(element * trained, DDP_BUCKET_BYTES)
            communication += reducing
    elif world > 1 and setting.strategy == "fast_ddp":
        communication = (2 if card.kind == "hpu" else FP32) * trained  # the fused buffer: bf16 on a Gaudi, else fp32
    elif setting.strategy == "fsdp":
        low = FP32 if workload.precision == "fp32" and loaded_bytes(workload) == FP32 else 2
        layer = shape.layer_parameters()
        layer_trained = layer if adapters is None else adapter_layer_parameters(shape, adapters)
        unsharded = shape.embedding_parameters() + shape.head_parameters()  # the root unit, kept gathered
        # two layers gathered (one prefetched) in the compute dtype, one layer's unsharded gradient
        communication = unsharded * low + 2 * layer * low + element * layer_trained
    return communication, reducing


def _reserve_bytes(card: Card, assumptions: Assumptions) -> float:
    """The runtime's own memory on ``card``: the given reserve, else the assumed one for its kind."""
    if assumptions.reserve_gb is not None:
        return assumptions.reserve_gb.value * GB
    if card.kind == "hpu":
        return assumptions.reserve_fraction_hpu.value * card.memory_gb * GB
    if card.kind == "cuda":
        return assumptions.reserve_gb_cuda.value * GB
    return assumptions.reserve_gb_cpu.value * GB


def _workspace_bytes(card: Card, assumptions: Assumptions, activations: float, logits: float) -> float:
    """On a CPU, what a training process holds beyond its tensors; on a card it is part of the reserve."""
    if card.kind != "cpu":
        return 0.0
    # glibc keeps a share of the blocks the backward frees: it grows with what it frees
    kept = assumptions.workspace_share_cpu.value * (activations + logits)
    return assumptions.workspace_gb_cpu.value * GB + kept


def breakdown(
    shape: ModelShape, workload: Workload, setting: Setting, card: Card, assumptions: Assumptions | None = None
) -> Breakdown:
    """Per-card bytes of training ``shape`` with ``setting`` on ``card``."""
    assumptions = assumptions or Assumptions()
    adapters = workload.adapters
    if adapters is not None and setting.fp8:
        raise UserError("the planner does not count --fp8 with LoRA adapters (fp8 copies of frozen weights).")
    n = shape.parameters()
    trained = trained_parameters(shape, workload)  # n, or the adapters' alone beside n frozen weights
    dp_shards = workload.world if setting.strategy == "fsdp" else 1
    loaded, element = loaded_bytes(workload), trained_bytes(workload)  # a weight as loaded; a trained one

    weights = (loaded * n + (0 if adapters is None else FP32 * trained)) / dp_shards
    if setting.fp8:  # fp8 copies of the linear weights (and their transposes) beside the master ones
        weights += 2 * shape.layers * shape.layer_parameters() / dp_shards
    gradients = element * trained / dp_shards
    optimizer = 2 * element * trained / dp_shards
    activations = activation_bytes(shape, workload, setting) + weight_cast_bytes(shape, workload, setting)
    logits = logits_bytes(shape, workload, setting)
    head_trained = adapters is None and not setting.fused_loss  # the fused loss makes it in the forward
    head_gradient = element * shape.vocab * shape.hidden / dp_shards if head_trained else 0.0

    bucket_views = card.kind == "hpu" and setting.strategy == "ddp"  # devices/hpu.py: gradient_as_bucket_view
    communication, reducing = _communication_bytes(shape, workload, setting, card, trained, bucket_views)
    if card.kind == "hpu" and workload.hpu_graphs:
        activations *= 1 + assumptions.hpu_graph_fraction.value
    reserve = _reserve_bytes(card, assumptions)
    workspace = _workspace_bytes(card, assumptions, activations, logits)

    states = weights + optimizer + communication - reducing + workspace + reserve
    together = setting.accumulation > 1 or bucket_views
    if together:
        peak = states + reducing + gradients + activations + logits
    else:
        peak = states + max(activations + logits + head_gradient, gradients + reducing)
    return Breakdown(weights, gradients, optimizer, activations, logits, communication, workspace, reserve, peak)
