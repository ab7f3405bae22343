"""A stage's torch compute: tensors in, tensors out. No transport here (and never grpc).

Training keeps each micro-batch's autograd graph between its forward and its backward, keyed by
(step, micro_batch); gradients accumulate across micro-batches and the optimizer steps once per step.
The last stage's loss is CrossEntropy(sum) / (batch_size × labels per sample: 1, or a GPT's block_size),
so the summed micro-batch gradients equal the gradient of the whole batch's mean loss over every label.
With bf16 precision the forward (and so the backward) runs under autocast; what leaves a stage is float32.
A layer that draws random numbers (dropout) draws them seeded by (seed, training step, micro-batch, layer)
(arceus.model.seeding); buffers that training updates (BatchNorm's) move once a step, by the mean of the
micro-batches' changes, each forward starting from the step's start (arceus.model.buffers).
With staleness 1 (PipeDream-2BW, `stale_begin`) a train step's forwards and backwards use a version of the weights
of its own, the one before the previous step's update, while that update writes a fresh copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from arceus.checkpoint import copy_stored, stored_layout
from arceus.contracts.assignment import OptimizerConfig
from arceus.model.autocast import autocast
from arceus.model.buffers import BufferSteps
from arceus.model.build import global_param_name, named_global_parameters
from arceus.model.decoding import DecodeState, decode, decodes
from arceus.model.expected_state import OPTIMIZER_STATE_KEYS, optimizer_entry_layout, optimizer_kind
from arceus.model.layout import TensorLayout
from arceus.model.optimizers import load_saved_state, make_optimizer, saved_state
from arceus.model.seeding import draw_seed, draws_random, seeded_draws
from arceus.safetensors_file import BUFFER_PREFIX, OPTIMIZER_PREFIX
from nodeagent.device import synchronize

MicroBatchKey = tuple[int, int]  # (step, micro_batch)


@dataclass
class RuntimeCounters:
    samples: int = 0  # forward samples, training and evaluation
    micro_batches: int = 0
    compute_seconds: float = 0.0


class StageRuntime:
    def __init__(
        self,
        layers: nn.Sequential,
        *,
        optimizer: OptimizerConfig | None,
        is_first: bool,
        is_last: bool,
        input_layout: TensorLayout,
        max_micro_batch_size: int,
        device: torch.device,
        precision: str = "fp32",
        activation_checkpointing: bool = False,
        seed: int = 0,
    ) -> None:
        """`seed`: the job's, which (with the training step, micro-batch and layer) seeds dropout's masks.
        `activation_checkpointing`: between a micro-batch's forward and backward keep only each layer's
        input and recompute the layer's activations in the backward (less memory, a second forward).
        `optimizer` None: a stage that only decodes (a served job's): no optimizer, its weights need no gradients,
        and it loads only the weights of a checkpoint."""
        self.device = device
        self.precision = precision
        self.activation_checkpointing = activation_checkpointing
        self.layers = layers.to(device)
        self.seed = seed
        # (the layer's index in the model, or None for one that draws no random numbers) per layer
        self._draws = [int(name) if draws_random(layer) else None for name, layer in layers.named_children()]
        self.buffers = BufferSteps(self.layers)
        if optimizer is None:
            self.layers.requires_grad_(False)
        self.optimizer = None if optimizer is None else make_optimizer(
            list(self.layers.parameters()), optimizer.name, optimizer.lr, momentum=optimizer.momentum,
            weight_decay=optimizer.weight_decay,
        )
        self.optimizer_name = None if optimizer is None else optimizer_kind(optimizer.name, optimizer.momentum)
        self.is_first = is_first
        self.is_last = is_last
        self.input_layout = input_layout
        self.max_micro_batch_size = max_micro_batch_size
        self.counters = RuntimeCounters()
        self._deferred: tuple[float | None] | None = None  # a deferred optimizer step's learning rate
        # Held while the weights change (the optimizer step) and while a sampler decodes with them, which it
        # may do between or during training steps: a sample never sees half-updated weights.
        self._weights_lock = threading.Lock()
        # key -> (input that needs a gradient, or None on the first stage; output or scaled loss)
        self._pending: dict[MicroBatchKey, tuple[torch.Tensor | None, torch.Tensor]] = {}
        # Staleness 1: each open train step's weights (leaves in `parameters()` order, their gradients its own), by
        # step; the weights before the last update while no step is open (the next step's); whether updates keep
        # the weights they replace (`optimizer_step`).
        self._versions: dict[int, list[torch.Tensor]] = {}
        self._previous: list[torch.Tensor] | None = None
        self._two_versions = False
        # The parameters themselves, kept here: while a step's forward runs with its version (`_Versioned`), the
        # layers hold the version's tensors in their place.
        self._params = list(self.layers.parameters())
        self._named = dict(self.layers.named_parameters(remove_duplicate=False))
        # The stage computes one thing at a time (`_timed`): two overlapping steps' threads take turns, so a version
        # is in the layers for one call at a time, the agent computes with the threads it was given, and the compute
        # counted is what ran (each thread's own too, `thread_compute_seconds`).
        self._computing = threading.Lock()
        self._thread = threading.local()
        # Per layer, (parameter name, its index in `_params`): a version's tensors by each layer's own names.
        index = {id(p): i for i, p in enumerate(self._params)}
        self._layer_params = [
            [(name, index[id(p)]) for name, p in layer.named_parameters(remove_duplicate=False)]
            for layer in self.layers
        ]

    # --- training -------------------------------------------------------------------------------
    def forward(self, key: MicroBatchKey, x: torch.Tensor, train_step: int | None = None) -> torch.Tensor:
        """Forward one micro-batch keeping its graph; returns the output (detached, on CPU) to send on.
        `train_step`: the training step it belongs to, which seeds its draws (default: the key's step)."""
        with self._timed(samples=len(x)), self._autocast():
            inp = self._input(x)
            out = self._train_forward(inp, key, train_step)
            self._pending[key] = (None if self.is_first else inp, out)
            return out.detach().float().cpu()  # activations travel as float32 whatever the compute dtype

    def forward_loss(
        self, key: MicroBatchKey, x: torch.Tensor, labels: torch.Tensor, batch_size: int, train_step: int | None = None
    ) -> tuple[float, int]:
        """Last stage: forward and loss; returns (sum of per-label losses, correct predictions)."""
        with self._timed(samples=len(x)), self._autocast():
            inp = self._input(x)
            loss_sum, correct = _loss_sum(self._train_forward(inp, key, train_step), labels.to(self.device))
            labels_per_sample = labels[0].numel()
            self._pending[key] = (None if self.is_first else inp, loss_sum / (batch_size * labels_per_sample))
            return float(loss_sum.detach()), correct

    def backward(self, key: MicroBatchKey, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backward one micro-batch (the last stage passes no gradient: it uses its own loss); returns
        the gradient w.r.t. this stage's input (on CPU), or None on the first stage."""
        inp, out = self._pending.pop(key)
        with self._timed():
            if grad_output is None:
                out.backward()
            else:
                if grad_output.shape != out.shape:
                    raise ValueError(
                        f"gradient of shape {list(grad_output.shape)} for an output of shape "
                        f"{list(out.shape)}"
                    )
                out.backward(grad_output.to(self.device, out.dtype))
            self.buffers.restore()  # activation checkpointing's recompute ran the layers' forward again
            return None if inp is None else inp.grad.detach().cpu()

    def stale_begin(self, step: int) -> None:
        """Staleness 1: the weights train step `step` (keys (step, m)) runs its forwards and backwards with, taken
        before its first forward: those before the last update where no other step is open (the step before this one
        finished: its update is the last), else the current ones (the step before is still open: its update, later,
        writes a fresh copy and leaves these be). Either way the weights before the previous step's update:
        W(t+1) = W(t) - lr * g(W(t-1)). ValueError for layers with buffers that training updates (their per-step
        moves assume one step at a time)."""
        if self.buffers.elements:
            raise ValueError("staleness 1 is not supported for layers with buffers that training updates (BatchNorm)")
        with self._weights_lock:
            if step in self._versions:
                raise ValueError(f"train step {step} already took its weights")
            weights = self._previous if self._previous is not None and not self._versions else [
                p.data for p in self._params
            ]
            self._previous = None
            self._two_versions = True
            self._versions[step] = [w.detach().requires_grad_(p.requires_grad)
                                    for w, p in zip(weights, self._params, strict=True)]

    def stale_gradients(self, step: int) -> None:
        """Staleness 1, once train step `step`'s backwards are done (and the step before it took its update): its
        gradients become the ones the exchange, tied sums and `optimizer_step` see; its weights version is let go."""
        with self._weights_lock:
            version = self._versions.pop(step)
        for p, leaf in zip(self._params, version, strict=True):
            p.grad = leaf.grad

    def optimizer_step(self, learning_rate: float | None = None) -> None:
        if self.optimizer is None:
            raise ValueError("this stage only decodes (it is served for inference): it has no optimizer to step")
        with self._timed():
            if learning_rate:
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate
            with self._weights_lock:
                if self._two_versions:  # staleness 1: the step in flight keeps the weights it started with
                    replaced = [p.data for p in self._params]
                    for p, data in zip(self._params, replaced, strict=True):
                        p.data = data.clone()
                    self._previous = None if self._versions else replaced
                self.optimizer.step()
                self.buffers.apply()
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_keys(self) -> frozenset[str]:
        """The per-parameter entries this stage's optimizer keeps (none without an optimizer)."""
        return frozenset() if self.optimizer_name is None else OPTIMIZER_STATE_KEYS[self.optimizer_name]

    def exchange_elements(self) -> int:
        """Elements of `gradient_vector`."""
        return sum(p.numel() for p in self.layers.parameters()) + self.buffers.elements

    def gradient_vector(self) -> torch.Tensor:
        """The accumulated gradients of every parameter, flattened in parameter order into one float32 CPU
        vector (zeros for a parameter without one), then the step's buffer changes and its micro-batch count
        where the layers have buffers (arceus.model.buffers): what the replicas of a stage exchange (sum)."""
        return torch.cat([
            *((p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
              for p in self.layers.parameters()),
            self.buffers.vector(),
        ])

    def parameter_gradient(self, name: str) -> torch.Tensor:
        """The accumulated gradient of the pipeline parameter `name` ("layers.<i>.<name>") as float32 on CPU (zeros
        where it has none): a tied weight's copy's share of its group's sum (arceus.model.tied)."""
        param = self._named[name.removeprefix("layers.")]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        return grad.detach().float().cpu()

    def set_parameter_gradient(self, name: str, grad: torch.Tensor) -> None:
        """Make `grad` (its shape) the gradient the pipeline parameter `name` steps with."""
        param = self._named[name.removeprefix("layers.")]
        if grad.shape != param.shape:
            raise ValueError(f"a gradient of shape {list(grad.shape)} for {name} of shape {list(param.shape)}")
        param.grad = grad.to(param.device, param.dtype)

    def set_gradient_vector(self, flat: torch.Tensor) -> None:
        """Replace the accumulated gradients with `flat` (`gradient_vector`'s layout); a parameter without a
        gradient keeps none (no forward used it, on any replica: they run the same layers). The stage takes `flat`
        over: where its device and dtype are the parameters', the gradients are views of it (no copy), so the
        caller must not change it after."""
        params = list(self.layers.parameters())
        total = self.exchange_elements()
        if flat.shape != (total,):
            raise ValueError(f"a gradient vector of shape {list(flat.shape)} for {total} parameter and buffer elements")
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
        self.buffers.set_vector(flat[offset:])

    def recompute_partial(
        self, micro_batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]], *, batch_size: int, train_step: int
    ) -> torch.Tensor:
        """The partial vector (`gradient_vector`'s layout) a replica of this stage computes from `micro_batches` of
        training step `train_step` (a sibling's, recomputed for an audit with this replica's weights of the step),
        each (micro-batch index, input, the gradient its output received) or, on the last stage, (index, input,
        labels) scaled as `forward_loss` scales the loss. Each forward draws what the step's did (seeded by the
        step, micro-batch and layer) and starts from the buffers as the step found them, as the audited replica's
        did. The stage's own gradients, graphs and buffer changes of the step stay as they were (nothing is written
        to `.grad`). ValueError for inputs, gradients or labels that do not fit the layers."""
        params = list(self.layers.parameters())
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        with self.buffers.set_aside():
            for micro_batch, x, target in micro_batches:
                try:
                    with self._autocast():
                        out = self._train_forward(self._input(x), (train_step, micro_batch), train_step)
                        if self.is_last:
                            loss_sum, _ = _loss_sum(out, target.to(self.device))
                            root, grad = loss_sum / (batch_size * target[0].numel()), None
                        else:
                            if target.shape != out.shape:
                                raise ValueError(
                                    f"a gradient of shape {list(target.shape)} for an output of {list(out.shape)}"
                                )
                            root, grad = out, target.to(self.device, out.dtype)
                    grads = torch.autograd.grad(root, params, grad_outputs=grad, allow_unused=True)
                except RuntimeError as exc:  # torch's shape and dtype errors: the micro-batch does not fit the layers
                    raise ValueError(f"cannot recompute the partial gradient: {exc}") from None
                self.buffers.restore()  # activation checkpointing's recompute ran the layers' forward again
                total += torch.cat([
                    (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                    for g, p in zip(grads, params, strict=True)
                ])
            return torch.cat([total, self.buffers.vector()])

    def defer_optimizer_step(self, learning_rate: float | None = None) -> None:
        """Keep the accumulated gradients and step later (`settle`): until then the weights are the ones
        this step's forwards used, so a spot check can read them without a copy of them being kept."""
        self._deferred = (learning_rate,)

    def _forget_versions(self) -> None:
        with self._weights_lock:
            self._versions.clear()
            self._previous = None

    def discard_deferred(self) -> None:
        """Forget a deferred optimizer step and its gradients: the step it belonged to is being run again."""
        self._deferred = None
        self.buffers.discard()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def take_back_deferred(self) -> None:
        """Forget a deferred optimizer step but keep the gradients: the step it belonged to is being repaired (its
        exchange runs again among the replicas left), and the update waits for the repaired step's end."""
        self._deferred = None

    def settle(self) -> bool:
        """Take a deferred optimizer step, if one waits; whether one did."""
        if self._deferred is None:
            return False
        (learning_rate,), self._deferred = self._deferred, None
        self.optimizer_step(learning_rate)
        return True

    def abort_step(self) -> None:
        """Forget a failed step: its graphs and any partly accumulated gradients (a deferred optimizer step
        of an earlier step was taken before this one began)."""
        self._pending.clear()
        self._forget_versions()
        self.buffers.discard()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    # --- evaluation -----------------------------------------------------------------------------
    # Evaluating changes no buffer: an exported layer captured in train mode updates its BatchNorm's statistics
    # in any forward, so they are put back after.
    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self._timed(samples=len(x)), self._autocast():
            out = self.layers(self._checked(x).to(self.device)).float().cpu()
        self.buffers.restore()
        return out

    def eval_loss(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        with torch.no_grad(), self._timed(samples=len(x)), self._autocast():
            loss_sum, correct = _loss_sum(self.layers(self._checked(x).to(self.device)), labels.to(self.device))
        self.buffers.restore()
        return float(loss_sum), correct

    # --- decoding (sampling text through the pipeline) --------------------------------------------
    def decode(self, x: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """The next positions `x` of a sequence through this stage's layers, extending `state` (their key/
        value caches): token ids [batch, t] on the first stage, activations [batch, t, d] on the others. The
        last stage returns the last position's logits [batch, vocab]; the others their activations. Not
        training work: nothing is counted. ValueError naming what is wrong with `x`."""
        layout = self.input_layout
        window = layout.shape[0]
        if not decodes(self.layers):
            raise ValueError("this stage's layers do not decode a position at a time (only a text model's do)")
        expected = f"[batch, positions, {', '.join(map(str, layout.shape[1:]))}]".replace(", ]", "]")
        if x.dim() != len(layout.shape) + 1 or tuple(x.shape[2:]) != layout.shape[1:] or x.shape[1] < 1:
            raise ValueError(f"expected input of shape {expected}, got {list(x.shape)}")
        if x.dtype != getattr(torch, layout.dtype):
            raise ValueError(f"expected {layout.dtype} input, got {x.dtype}")
        if not 1 <= len(x) <= self.max_micro_batch_size:
            raise ValueError(f"a batch of {len(x)} sequences; this stage decodes 1 to {self.max_micro_batch_size}")
        if state.position + x.shape[1] > window:
            raise ValueError(
                f"positions {state.position} to {state.position + x.shape[1] - 1} are past the model's window "
                f"of {window}; start a new sequence with the last {window} tokens"
            )
        if layout.bound is not None and (int(x.min()) < 0 or int(x.max()) >= layout.bound):
            raise ValueError(f"token ids must lie in [0, {layout.bound})")
        with self._weights_lock, torch.no_grad(), self._autocast():
            out = decode(self.layers, x.to(self.device), state)
        return (out[:, -1, :] if self.is_last else out).float().cpu()

    # --- inspection and checkpoints ---------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of this stage's parameters under their model-wide names ("layers.2.weight")."""
        return {name: p.detach().cpu().clone() for name, p in named_global_parameters(self.layers)}

    def state_items(
        self, *, include_optimizer_state: bool = True, include_buffers: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """This stage's state as named tensors, the tensors themselves (no copies): its weights, (optionally) its
        optimizer state, and (optionally) the buffers training updates, as "buffer.<model-wide name>". With both,
        the one state of a stage: what its checkpoints hold, what a joining replica copies from a sibling and what
        the replicas' state digests cover. They change with the next step.

        Optimizer entries are "optimizer.<parameter name>.<state key>" (e.g. "...weight.exp_avg"), so a
        checkpoint is plain tensors (safetensors) and never a pickled optimizer object.
        """
        params = list(named_global_parameters(self.layers))
        items = [(name, p.detach()) for name, p in params]
        if include_optimizer_state and self.optimizer is not None:
            for name, param in params:
                for key, value in saved_state(self.optimizer, param).items():
                    items.append((f"{OPTIMIZER_PREFIX}{name}.{key}", value.detach()))
        if include_buffers:
            items.extend((f"{BUFFER_PREFIX}{global_param_name(n)}", b.detach()) for n, b in self.buffers.named())
        return items

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """CPU copies of `state_items()`."""
        return {name: t.cpu().clone() for name, t in self.state_items()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], *, widen: bool = False) -> None:
        """Restore weights, optimizer state and buffers saved by `state_items` (of a stage with the same layers and
        optimizer); ValueError naming the first mismatch, before anything is changed. `widen`: a float32 weight may
        be stored as bfloat16 or float16 (uploaded initial weights: a Hugging Face checkpoint's), widened exactly as
        it is copied in. A state without any buffer
        (the job's uploaded initial weights, or a checkpoint saved before stages kept their buffers) leaves the
        buffers as the layers were built with them (an exported model's: as captured); one with some holds exactly
        this stage's. `tensors` may load lazily (`arceus.checkpoint.StateFile`): each tensor is then read straight
        into its place (`copy_stored`), a weight into its parameter and an optimizer entry into the one tensor the
        optimizer keeps, so loading takes no memory beside the stage's own. A stage without an optimizer (served
        for inference) loads the weights alone: the optimizer entries are never read."""
        params = dict(named_global_parameters(self.layers))
        weights = [k for k in tensors if not k.startswith((OPTIMIZER_PREFIX, BUFFER_PREFIX))]
        _check_layouts(tensors, weights, params, "checkpoint", "this stage", widen=widen)
        buffers = self._buffers_check(tensors)
        self._forget_versions()  # staleness 1: the loaded weights are the next step's (no older version is saved)
        if self.optimizer is None:
            with torch.no_grad():
                for name, param in params.items():
                    copy_stored(tensors, name, param)
            self._load_buffers(tensors, buffers)
            return
        entries: dict[str, set[str]] = {}
        for key in tensors:
            if not key.startswith(OPTIMIZER_PREFIX):
                continue
            name, _, entry = key.removeprefix(OPTIMIZER_PREFIX).rpartition(".")
            if name not in params:
                raise ValueError(f"checkpoint optimizer entry {key} names no parameter of this stage")
            _, shape = stored_layout(tensors, key)
            if entry in OPTIMIZER_STATE_KEYS[self.optimizer_name]:
                _, want = optimizer_entry_layout(self.optimizer_name, entry, list(params[name].shape))
                if shape != want:
                    raise ValueError(
                        f"checkpoint optimizer entry {key} is {shape}; parameter {name} is "
                        f"{list(params[name].shape)}, of which a {self.optimizer_name} optimizer keeps {entry} {want}"
                    )
            entries.setdefault(name, set()).add(entry)
        expected = OPTIMIZER_STATE_KEYS[self.optimizer_name]
        for name, keys in entries.items():
            if keys != expected:
                raise ValueError(
                    f"checkpoint optimizer state of {name} has {sorted(keys)}; "
                    f"this stage's {self.optimizer_name} optimizer keeps {sorted(expected)}"
                )
        self.optimizer.state.clear()
        with torch.no_grad():
            for name, param in params.items():
                copy_stored(tensors, name, param)
                # A copy of its own, one tensor at a time: the caller's mapping may share its tensors.
                for entry in sorted(entries.get(name, ())):
                    key = f"{OPTIMIZER_PREFIX}{name}.{entry}"
                    dtype, shape = stored_layout(tensors, key)
                    value = torch.empty(shape, dtype=dtype)
                    copy_stored(tensors, key, value)
                    load_saved_state(self.optimizer, param, {entry: value}, owned=True)
        self._load_buffers(tensors, buffers)

    def _buffers_check(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's buffers by the names `tensors` gives them, if it holds any ("buffer.<name>", a sibling's
        snapshot): then exactly this stage's, each its dtype and shape (ValueError naming the first that is not)."""
        given = [k for k in tensors if k.startswith(BUFFER_PREFIX)]
        if not given:
            return {}
        own = {f"{BUFFER_PREFIX}{global_param_name(n)}": b for n, b in self.buffers.named()}
        _check_layouts(tensors, given, own, "state", "this stage's buffers")
        return own

    def _load_buffers(self, tensors: Mapping[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        for name, buffer in buffers.items():
            buffer.data.copy_(tensors[name])
        if buffers:
            self.buffers.rebind()  # the loaded values are the next step's start

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        # The transport validates first; this guards callers that skip it (benchmarks, tests).
        layout = self.input_layout
        if x.dim() < 1 or tuple(x.shape[1:]) != layout.shape:
            raise ValueError(f"expected input of shape {layout.batch_shape()}, got {list(x.shape)}")
        if x.dtype != getattr(torch, layout.dtype):
            raise ValueError(f"expected {layout.dtype} input, got {x.dtype}")
        if not 1 <= len(x) <= self.max_micro_batch_size:
            raise ValueError(
                f"micro-batch of {len(x)} samples; this stage takes 1 to {self.max_micro_batch_size}"
            )
        return x

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        inp = self._checked(x).to(self.device)
        # Later stages need the gradient w.r.t. their input to send it upstream.
        return inp if self.is_first else inp.detach().requires_grad_(True)

    def _train_forward(self, x: torch.Tensor, key: MicroBatchKey, train_step: int | None) -> torch.Tensor:
        """The layers' forward, keeping its graph for the backward; with activation checkpointing each layer
        keeps only its input and runs again in the backward (same ops on the same input, the same draws:
        same result). The buffers' change is taken and they are put back (`BufferSteps.forwarded`)."""
        step, micro_batch = (key[0] if train_step is None else train_step), key[1]
        version = self._versions.get(key[0])
        for layer, index, names in zip(self.layers, self._draws, self._layer_params, strict=True):
            seed = None if index is None else draw_seed(self.seed, step, micro_batch, index)
            if version is not None:  # staleness 1: this step's own weights
                layer = _Versioned(layer, {name: version[i] for name, i in names})
            run = layer if seed is None else _Seeded(layer, seed, self.device)
            x = checkpoint(run, x, use_reentrant=False) if self.activation_checkpointing else run(x)
        self.buffers.forwarded()
        return x

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.precision)

    def thread_compute_seconds(self) -> float:
        """The compute the calling thread ran here (a step's own, where two steps overlap)."""
        return getattr(self._thread, "seconds", 0.0)

    @contextmanager
    def _timed(self, samples: int = 0) -> Iterator[None]:
        with self._computing:
            start = time.perf_counter()
            yield
            synchronize(self.device)  # kernels are asynchronous (CUDA, MPS): time what actually ran
            seconds = time.perf_counter() - start
            self.counters.compute_seconds += seconds
            self._thread.seconds = self.thread_compute_seconds() + seconds
            if samples:
                self.counters.samples += samples
                self.counters.micro_batches += 1


class _Versioned:
    """A layer called with other tensors in place of its parameters (a train step's weights version). The call puts
    them in the layer for its duration: it runs only within the stage's compute (`StageRuntime._timed`), one at a
    time, a recompute in a backward (activation checkpointing) too."""

    def __init__(self, layer: nn.Module, params: dict[str, torch.Tensor]) -> None:
        self.layer, self.params = layer, params

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.layer, self.params, (x,))


class _Seeded:
    """A layer called with its draws seeded (arceus.model.seeding.seeded_draws): on each call, so a recompute draws
    the same."""

    def __init__(self, layer: nn.Module | _Versioned, seed: int, device: torch.device) -> None:
        self.layer, self.seed, self.device = layer, seed, device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with seeded_draws(self.seed, self.device):
            return self.layer(x)


def _check_layouts(
    tensors: Mapping[str, torch.Tensor], given: list[str], own: Mapping[str, torch.Tensor], source: str, what: str,
    *, widen: bool = False,
) -> None:
    """ValueError naming the first mismatch unless the names `given` (of `tensors`, from `source`) are exactly `own`'s
    (`what`: the part of this stage they load into), each stored with its dtype (`widen`: a float32 one may be
    stored as bfloat16 or float16) and shape."""
    if set(given) != set(own):
        missing, extra = sorted(set(own) - set(given)), sorted(set(given) - set(own))
        raise ValueError(f"{source} does not match {what}: missing {missing}, unexpected {extra}")
    for name, tensor in own.items():
        dtype, shape = stored_layout(tensors, name)
        widens = widen and tensor.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)
        if shape != list(tensor.shape) or dtype != tensor.dtype and not widens:
            raise ValueError(
                f"{source} tensor {name} is {dtype} {shape}; this stage has {tensor.dtype} {list(tensor.shape)}"
            )


def _loss_sum(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross entropy and correct predictions over every label: one per sample ([B, C] logits) or
    one per position ([B, T, V] logits, a GPT's next tokens)."""
    flat_logits, flat_target = logits.flatten(0, -2), target.flatten()
    loss_sum = F.cross_entropy(flat_logits, flat_target, reduction="sum")
    return loss_sum, int((flat_logits.detach().argmax(dim=-1) == flat_target).sum())
