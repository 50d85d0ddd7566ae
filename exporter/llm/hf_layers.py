"""The generic step's op vocabulary and layer loop, for any transformers causal LM (models/hf_causal.py).

Two rewrites of a loaded transformers model, both done once before export:

  * `sixteen_bit(model, dtype)`: every 16-bit matrix goes through the `hloserve.layer_linear`
    composite (runtime/artifact/kernels.py), as on the hand-written Llama step: each nn.Linear
    becomes a `LayerLinear` reading its matrix where it lies in a stack [L, out, in] (the
    stacked decoder weights, or a stack of one); the embedding table is stored in the same
    16-bit dtype and the LM head, tied or not, reads it through the composite.
  * `scan(model, step_kwarg, carried)`: the decoder layers' ModuleList becomes a `ScannedLayers`:
    their weights stacked on a leading [L] dim and ONE layer traced as the body of a torch scan
    (a StableHLO while loop), so XLA compiles one layer, not L. A static attribute in which layers
    differ and which the step can take as data (`PerLayer`: Gemma's sliding window) is carried as
    a per-layer row of the scan and handed to the step (`step.at`), so Gemma 3's five sliding and
    one global layer are one body; what differs between layers as arguments (Gemma 3's local and
    global rotary tables) is selected per layer inside the body (the distinct tables stacked once,
    a per-layer index picking one). Layers that differ in any other static attribute are scanned
    as a repeating period of layers, the last L % period unrolled after it; where the layers'
    pattern changes along the list (a GGUF's K-quant mix: llama.cpp gives its first and last
    eighth and every third layer between more bits), as consecutive segments, each a scan of its
    own period (`layer_plan`), so the step traces few layer bodies and passes few weight
    arguments instead of unrolling the whole pattern.

How the layer loop is taken over without model-specific code: the model's own forward still
iterates over `self.layers[:n]` and calls each layer. ScannedLayers hands it one stand-in per
layer; each stand-in records its call's arguments and returns the hidden states unchanged,
and the last one runs the scan over all recorded calls. That requires the model to pass each
layer's output straight to the next layer (checked: anything else is refused at export with
the layer it happened at, and the step is exported unrolled).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .._private import scan_lifted
from ..composites import layer_linear, paged_attention  # noqa: F401 - registers torch.ops.hloserve.*
from .hf_experts import expert_matrices, is_experts, sixteen_bit_experts
from .layer_plan import Segment, layer_plan
from .step import holds_of


class LayerLinear(torch.nn.Module):
    """y = x W^T + b, W [out, in] 16-bit (stored as the int16 bits of `dtype`), through the
    layer_linear composite: x is rounded to the weights' dtype and the sums are f32 (its
    contract); the result has x's dtype. A scanned layer loop (ScannedLayers) substitutes a stack
    [L, out, in] for the tensors in IN_PLACE and the scan's iteration for `layer`: the matrix is
    then read where it lies in the stack."""

    IN_PLACE = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.holds = dtype, holds_of(dtype)
        self.in_features, self.out_features = weight.shape[-1], weight.shape[-2]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)      # [out, in] int16 bits
        self.bias = bias
        self.register_buffer("layer", torch.zeros((), dtype=torch.int32), persistent=False)

    @classmethod
    def of(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> "LayerLinear":
        bits = linear.weight.detach().to(dtype).view(torch.int16)          # [out, in]
        bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        return cls(bits, bias, dtype)

    def forward(self, x):
        w = self.weight if self.weight.dim() == 3 else self.weight[None]  # [L, out, in]
        y = torch.ops.hloserve.layer_linear(x.float(), w, self.layer, self.holds).to(x.dtype)
        return y if self.bias is None else y + self.bias


class TableHead(torch.nn.Module):
    """An LM head tied to a 16-bit embedding table [V, hidden]: the table read in place through the
    layer_linear composite (a stack of one), logits f32."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.embedding = embedding          # shared: its weight is the artifact's one table
        self.out_features = embedding.weight.shape[0]

    @property
    def weight(self) -> torch.Tensor:       # transformers' tie checks read lm_head.weight
        return self.embedding.weight

    def forward(self, h):
        zero = torch.zeros((), dtype=torch.int32, device=h.device)
        table = self.embedding.weight
        return torch.ops.hloserve.layer_linear(h.float(), table[None], zero, holds_of(table.dtype))   # [.., V]


def sixteen_bit(model: torch.nn.Module, dtype: torch.dtype, act: torch.dtype | None = None) -> int:
    """Store `model`'s matrices in `dtype` (bfloat16 or float16) under its wider activations `act`
    (default: the embedding table's dtype): every nn.Linear becomes a LayerLinear, the input
    embedding table is narrowed (its lookups widened back to `act`) and a tied LM head reads that
    table through the composite; a table quantized already (with its tied head) only gives its lookups
    in `act`. Returns how many linear layers were swapped."""
    emb = model.get_input_embeddings()
    if isinstance(emb, torch.nn.Embedding):
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is emb.weight
        act = act or emb.weight.dtype
        emb.weight = torch.nn.Parameter(emb.weight.detach().to(dtype), requires_grad=False)
        emb.register_forward_hook(lambda module, args, out: out.to(act))
        if tied:
            _replace(model, head, TableHead(emb))
    elif act is not None:   # a table stored quantized already (QuantRequest.table), its tied head too
        emb.dtype = act
    swapped = 0
    for m in list(model.modules()):
        if is_experts(m):
            sixteen_bit_experts(m, dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_matrix_module(child):
                continue
            if type(child) is torch.nn.Linear:
                setattr(parent, name, LayerLinear.of(child, dtype))
                swapped += 1
            else:   # GPT-2's linear: W [in, out]
                linear = torch.nn.Linear(*child.weight.shape, bias=child.bias is not None)
                linear.weight, linear.bias = torch.nn.Parameter(child.weight.detach().t()), child.bias
                setattr(parent, name, LayerLinear.of(linear, dtype))
                swapped += 1
    return swapped


# Sibling projections that read the same input, fused into one composite call (issue #37: one
# launch instead of three on an accelerator, one pass over the pool instead of three on a CPU), and
# the name the fused matrix takes in their module. tensor_parallel_dims splits both by rows.
FUSED = {("q_proj", "k_proj", "v_proj"): "fused_qkv_proj", ("gate_proj", "up_proj"): "fused_gate_up_proj"}


class FusedLinear(LayerLinear):
    """Sibling LayerLinears of one module that read the same input (q/k/v, gate/up) as one matrix.

    Their rows are interleaved in `groups` equal blocks, each block holding every sibling's share in
    turn (q/k/v: one block per KV head: its query heads' rows, then its key's, then its value's;
    gate/up: one block per row of each), so an even split of the rows over devices (tensor
    parallelism) hands each device whole blocks: whole KV heads with their query heads, matching
    gate and up rows. `part(x, i)` is sibling i's output, its rows in their own order: the fused
    product is computed once per input tensor (the model calls the siblings one after the other on
    the same tensor; another tensor gets a product of its own) and the sibling's columns taken back
    out of the blocks. Each output element is the same dot product over the same row as before."""

    def __init__(self, parts: list[LayerLinear], groups: int):
        shares = [p.out_features // groups for p in parts]
        weight = torch.cat([p.weight.reshape(groups, n, -1) for p, n in zip(parts, shares)], dim=1)
        bias = None
        if parts[0].bias is not None:
            bias = torch.nn.Parameter(torch.cat([p.bias.reshape(groups, n) for p, n in zip(parts, shares)], dim=1)
                                      .reshape(-1), requires_grad=False)
        super().__init__(weight.reshape(sum(p.out_features for p in parts), -1), bias, parts[0].dtype)
        self.groups, self.shares = groups, tuple(shares)
        self._last: tuple | None = None     # (input, fused product): the siblings' shared call

    def share(self, i: int) -> slice:
        """Sibling i's columns within each block."""
        lo = sum(self.shares[:i])
        return slice(lo, lo + self.shares[i])

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, self(x))
        y = self._last[1].unflatten(-1, (self.groups, sum(self.shares)))       # [..., groups, block]
        return y[..., self.share(i)].flatten(-2)


class FusedPart(torch.nn.Module):
    """What a fused sibling's name holds: its output, from its FusedLinear (hooks on it, a LoRA
    adapter's, still see its input and output)."""

    def __init__(self, fused: FusedLinear, index: int, like: LayerLinear):
        super().__init__()
        self._fused = (fused,)              # not a submodule: the fused matrix belongs to the parent
        self.index = index
        self.in_features, self.out_features = like.in_features, like.out_features

    def forward(self, x):
        return self._fused[0].part(x, self.index)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """This sibling's rows of the fused `t` (weight or bias), in their own order."""
        f = self._fused[0]
        blocks = t.reshape(f.groups, sum(f.shares), *t.shape[1:])
        return blocks[:, f.share(self.index)].reshape(self.out_features, *t.shape[1:])

    @property
    def weight(self) -> torch.Tensor:
        """The sibling's matrix as its LayerLinear held it (model code that reads `q_proj.weight`, its
        dtype or shape, still finds it): a view of the fused one's rows."""
        return self._rows(self._fused[0].weight)

    @property
    def bias(self) -> torch.Tensor | None:
        b = self._fused[0].bias
        return None if b is None else self._rows(b)


def fuse_projections(model: torch.nn.Module, num_kv_heads: int) -> int:
    """Fuse each module's q_proj/k_proj/v_proj and gate_proj/up_proj (FUSED) into one FusedLinear
    where all of them are 16-bit LayerLinears of one input size and dtype, with biases on all or none;
    q/k/v only where each divides into `num_kv_heads` blocks. A sibling quantized, or any other
    layout, is left as it is. Returns how many groups were fused."""
    fused = 0
    for parent in list(model.modules()):
        for names, fused_name in FUSED.items():
            parts = [getattr(parent, n, None) for n in names]
            if hasattr(parent, fused_name) or not all(type(p) is LayerLinear for p in parts):
                continue
            if len({(p.in_features, p.dtype, p.weight.dim(), p.bias is None) for p in parts}) != 1:
                continue
            groups = num_kv_heads if "q_proj" in names else parts[0].out_features
            if any(p.out_features % groups for p in parts):
                continue
            whole = FusedLinear(parts, groups)
            setattr(parent, fused_name, whole)
            for i, (n, p) in enumerate(zip(names, parts)):
                setattr(parent, n, FusedPart(whole, i, p))
            fused += 1
    return fused


def _is_matrix_module(module: torch.nn.Module) -> bool:
    """Whether sixteen_bit swaps `module` for a LayerLinear (nn.Linear, GPT-2's 2-D Conv1D)."""
    return type(module) is torch.nn.Linear or (type(module).__name__ == "Conv1D" and module.weight.dim() == 2)


def widen_all_but_matrices(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer of `model` in `dtype` (a copy, shared tensors stay
    shared), except the tensors sixteen_bit stores in 16 bits (the linear matrices and the input
    embedding table): a model loaded in its 16-bit checkpoint dtype then holds what loading it in
    `dtype` and sixteen_bit give (widening is exact)."""
    keep = {id(m.weight) for m in model.modules() if _is_matrix_module(m)}
    keep |= {id(t) for m in model.modules() for t in expert_matrices(m)}
    keep.add(id(model.get_input_embeddings().weight))
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or id(t) in keep or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in done:
                    wide = t.detach().to(dtype)
                    done[id(t)] = torch.nn.Parameter(wide, requires_grad=False) if isinstance(t, torch.nn.Parameter) else wide
                table[name] = done[id(t)]


def _replace(model: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList] | None:
    """(parent, attribute, ModuleList) of the model's decoder layers: the ModuleList with as many
    entries as the config's layer count (None if there is no such list)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == n and n > 1:
                return parent, name, child
    return None


def _static_signature(layer: torch.nn.Module, carried: frozenset[str] = frozenset()) -> tuple:
    """What must be equal for two layers to share one traced body: every submodule's type and plain
    attributes (not its tensors, not `layer_idx`, which the scan supplies, and not the `carried`
    ones, which the scan passes as data), every tensor's name, shape and dtype."""
    out = []
    for path, m in layer.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in ("layer_idx", "training") and k not in carried
                             and not isinstance(v, (torch.Tensor, torch.nn.Module))))
        out.append((path, type(m).__name__, attrs))
    out += [(n, tuple(t.shape), t.dtype) for n, t in (*layer.named_parameters(), *layer.named_buffers())]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """A plain attribute of a decoder layer's modules (`attribute`, e.g. "sliding_window") that may
    differ between the layers of one scanned body: each layer's value, as int32 (None: 0), is a row
    of the scan, passed to the step as `step.at(..., keyword=row)`. `labels` are attributes that
    say the same thing in other words (e.g. "is_sliding"), left out of the layers' signatures too:
    the body reads the first layer's, so a model whose forward reads them (or branches on the
    attribute itself) computes something else, which the caller's check must catch
    (models/hf_causal.scan_layers compares the scanned step with the unrolled one)."""
    attribute: str
    keyword: str
    labels: tuple[str, ...] = ()

    @property
    def names(self) -> frozenset[str]:
        return frozenset((self.attribute, *self.labels))

    def values(self, layer: torch.nn.Module) -> set:
        """The attribute's values in `layer`'s modules (one, where the layer has it consistently)."""
        return {vars(m)[self.attribute] for m in layer.modules() if self.attribute in vars(m)}


@dataclasses.dataclass
class _Call:
    hidden: torch.Tensor
    args: tuple
    kwargs: dict


class _StandIn:
    """What the model's layer loop sees in place of layer `i`: records the call; the last one runs
    the scan. Attribute reads go to the real layer (a loop may read `attention_type`)."""

    def __init__(self, owner: "ScannedLayers", i: int):
        self._owner, self._i = owner, i

    def __getattr__(self, name):
        return getattr(self._owner.original[self._i], name)

    def __call__(self, hidden_states, *args, **kwargs):
        return self._owner.record(self._i, hidden_states, args, kwargs)


class ScannedLayers(torch.nn.Module):
    """The decoder layers as scanned bodies over stacked weights (see the module docstring).

    `segments` (layer_plan) are the scans, in layer order. `stack.{k}` holds, for the k-th period
    position of all segments' positions in order (one segment: position j of each period), the
    weights of its layers stacked [iterations, ...] (the tensors a linear module reads in place,
    its IN_PLACE, are passed whole to the composite with the scan's iteration as `layer`; the
    others are sliced); `tail` are the layers no segment holds (one segment: the last L % period),
    unrolled where they lie in the list.

    The step's attention finds the cache and the layer index in the object passed to every layer
    as keyword `step_kwarg`: `step.at(layer, cache, tensors=...)` makes the one a layer call uses
    (created inside the scan body, so the body mutates nothing outside it; `tensors`: the step's
    `tensors()` as the body receives them), and its `.cache` afterwards is the cache that layer
    wrote. The body reads no tensor it is not passed (_private.scan_lifted): the stacks, the
    arguments the layers share, the step's tensors and the template's own buffers go in as the
    scan's additional inputs.
    """

    def __init__(self, layers: torch.nn.ModuleList, step_kwarg: str, carried: tuple[PerLayer, ...] = ()):
        super().__init__()
        L = len(layers)
        # a PerLayer attribute is carried as data only where it differs between layers and each layer
        # has one value of it; otherwise it stays a static attribute of the body
        per_layer = [[c.values(m) for m in layers] for c in carried]
        carried = tuple(c for c, vals in zip(carried, per_layer)
                        if all(len(v) == 1 for v in vals) and len({next(iter(v)) for v in vals}) > 1)
        excluded = frozenset(n for c in carried for n in c.names)
        self.segments = layer_plan([_static_signature(m, excluded) for m in layers])
        self.carried = carried
        self.num_layers = L
        self.step_kwarg = step_kwarg
        # the templates (one per stack, a segment's first period) are traced with each iteration's
        # weights substituted; they hold no weight of their own in the artifact (kept out of the module tree)
        object.__setattr__(self, "templates", [layers[g.start + j] for g in self.segments for j in range(g.period)])
        self.stack = torch.nn.ModuleList()
        # per stack: the stored name of each of the template's tensors, and which of them the
        # composite reads in place (the others are sliced per iteration by the scan)
        self.names: list[dict[str, str]] = []
        self.in_place: list[frozenset[str]] = []
        self.stacked_from: list[tuple[list[torch.Tensor], torch.Tensor]] = []   # (per-layer tensors, their stack)
        for g in self.segments:
            for j in range(g.period):
                group = [layers[i] for i in range(g.start + j, g.stop, g.period)]
                holder = torch.nn.Module()
                names, in_place = {}, set()
                for name in group[0].state_dict():       # parameters and persistent buffers (quantized weights)
                    parts = [_tensor(m, name).detach() for m in group]
                    stacked = torch.stack(parts)                                        # [iterations, ...]
                    self.stacked_from.append((parts, stacked))
                    if _read_in_place(group[0], name):
                        in_place.add(name)
                    names[name] = name.replace(".", "__")
                    holder.register_buffer(names[name], stacked)
                for c in carried:     # [iterations] int32: the layers' values of a carried attribute
                    rows = [int(next(iter(c.values(m))) or 0) for m in group]
                    holder.register_buffer(f"per_layer__{c.keyword}", torch.tensor(rows, dtype=torch.int32),
                                           persistent=False)
                self.stack.append(holder)
                self.names.append(names)
                self.in_place.append(frozenset(in_place))
        scanned = {i for g in self.segments for i in range(g.start, g.stop)}
        self.unrolled = [i for i in range(L) if i not in scanned]                # the tail's layers, in order
        self.tail = torch.nn.ModuleList(layers[i] for i in self.unrolled)
        object.__setattr__(self, "original", layers)      # what unscan() puts back
        self._calls: list[_Call] = []

    # the model's loop: `for layer in self.layers[:n]`, `len(self.layers)`, `self.layers[i]`
    def __len__(self):
        return self.num_layers

    def __iter__(self):
        return iter([_StandIn(self, i) for i in range(self.num_layers)])

    def __getitem__(self, index):
        return [_StandIn(self, i) for i in range(self.num_layers)][index]

    def record(self, i: int, hidden, args, kwargs):
        if i == 0:
            self._calls = []
        elif i != len(self._calls) or hidden is not self._calls[-1].hidden:
            self._calls = []
            raise ScanError(f"decoder layer {i} was not called with layer {i - 1}'s output (the model changes "
                            f"the hidden states between layers, or calls them out of order)")
        if not isinstance(hidden, torch.Tensor) or self.step_kwarg not in kwargs:
            raise ScanError(f"decoder layer {i} is called without the hidden states as its first argument or "
                            f"without the step's keyword arguments")
        self._calls.append(_Call(hidden, args, kwargs))
        if i < self.num_layers - 1:
            return hidden
        calls, self._calls = self._calls, []
        return self._run(calls)

    def _run(self, calls: list[_Call]):
        outer = calls[0].kwargs[self.step_kwarg]
        h, cache = calls[0].hidden, outer.cache
        first = 0                                  # the first stack of the next segment
        unrolled = dict(zip(self.unrolled, self.tail))
        i = 0
        while i < self.num_layers:
            if i in unrolled:
                step = outer.at(torch.tensor(i, dtype=torch.int32), cache)
                h, cache = self._layer(unrolled[i], h, calls[i].args, calls[i].kwargs, None, step)
                i += 1
                continue
            g = next(g for g in self.segments if g.start == i)
            h, cache = self._scan(g, first, calls, outer, h, cache)
            first += g.period
            i = g.stop
        outer.cache = cache
        return h

    def _scan(self, g: Segment, first: int, calls: list[_Call], outer, h, cache):
        """Segment `g` as one scan over its stacks (`first` .. `first + g.period - 1`)."""
        p = g.period
        positions, lifted = [], {"step": outer.tensors()}
        for j in range(p):
            rebuild, varying, shared = _split_arguments(calls[g.start + j:g.stop:p], g.start + j, self.step_kwarg)
            holder = self.stack[first + j]
            names, in_place_names = self.names[first + j], self.in_place[first + j]
            sliced, in_place = {}, {}
            for name, stored in names.items():
                (in_place if name in in_place_names else sliced)[name] = holder.get_buffer(stored)
            data = {c.keyword: holder.get_buffer(f"per_layer__{c.keyword}") for c in self.carried}
            # the template's own tensors that no stack replaces (non-persistent buffers): read as they are
            template = self.templates[first + j]
            own = {k: t for k, t in (*template.named_parameters(), *template.named_buffers())
                   if k not in names and k not in {_sibling(m, "layer") for m in in_place}}
            positions.append((rebuild, varying, sliced, data))
            lifted[j] = {"in_place": in_place, "shared": shared, "own": own}
        xs = [t for _, varying, sliced, data in positions for t in (*varying.values(), *sliced.values(), *data.values())]

        def body(carry, xs, lifted):
            h, cache = carry
            *xs, it = xs
            k = 0
            for j, (rebuild, varying, sliced, data) in enumerate(positions):
                rows = dict(zip(varying, xs[k:k + len(varying)]))
                k += len(varying)
                params = dict(zip(sliced, xs[k:k + len(sliced)]))
                k += len(sliced)
                per_layer = dict(zip(data, xs[k:k + len(data)]))
                k += len(data)
                params.update(lifted[j]["own"])
                params.update(lifted[j]["in_place"])
                params.update({_sibling(name, "layer"): it for name in lifted[j]["in_place"]})
                args, kwargs = rebuild(rows, lifted[j]["shared"])
                step = outer.at(g.start + it * p + j, cache, tensors=lifted["step"], **per_layer)
                h, cache = self._layer(self.templates[first + j], h, args, kwargs, params, step)
            return (h, cache), h.new_zeros(())

        steps = torch.arange(g.iterations, dtype=torch.int32)
        (h, cache), _ = scan_lifted(body, (h, cache), (*xs, steps), lifted)
        return h, cache

    def _layer(self, module, h, args, kwargs, params, step):
        """One decoder layer on `h`, its attention reading and writing the cache through `step`
        (`params`: the tensors substituted for the module's own, None: its own)."""
        kwargs = {**kwargs, self.step_kwarg: step}
        if params is None:
            out = module(h, *args, **kwargs)
        else:
            out = torch.func.functional_call(module, params, (h, *args), kwargs, strict=False)
        return out, step.cache


def scan(model: torch.nn.Module, step_kwarg: str, carried: tuple[PerLayer, ...] = ()) -> ScannedLayers | None:
    """Replace the model's decoder-layer list with a ScannedLayers (None if it has no such list)."""
    found = decoder_layers(model)
    if found is None:
        return None
    parent, name, layers = found
    scanned = ScannedLayers(layers, step_kwarg, carried)
    setattr(parent, name, scanned)
    return scanned


def unscan(model: torch.nn.Module) -> bool:
    """Put the decoder layers back as they were (a module swap such as --quantize works on them);
    returns whether there was a ScannedLayers."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, ScannedLayers):
                setattr(parent, name, child.original)
                return True
    return False


@contextlib.contextmanager
def unrolled(model: torch.nn.Module):
    """The model's decoder layers as they were inside the block, its ScannedLayers back after it."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, ScannedLayers)]
    for parent, name, child in found:
        setattr(parent, name, child.original)
    try:
        yield
    finally:
        for parent, name, child in found:
            setattr(parent, name, child)


class ScanError(ValueError):
    """The model's layer loop cannot be taken over by a scan (the step is exported unrolled)."""


def _tensor(layer: torch.nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(layer.get_submodule(owner) if owner else layer, attr)


def _read_in_place(layer: torch.nn.Module, name: str) -> bool:
    """Whether tensor `name` of `layer` is one its module reads where it lies in a stack (a linear
    composite's matrix and scales, the module's IN_PLACE), at the scan's iteration, not sliced."""
    owner, _, attr = name.rpartition(".")
    return attr in getattr(layer.get_submodule(owner) if owner else layer, "IN_PLACE", ())


def _sibling(name: str, attr: str) -> str:
    """The name of attribute `attr` of the module owning tensor `name` ("mlp.up.weight" -> "mlp.up.layer")."""
    owner = name.rpartition(".")[0]
    return f"{owner}.{attr}" if owner else attr


def _split_arguments(group: list[_Call], j: int, step_kwarg: str):
    """Of the calls at one period position, which arguments are the same object in every call
    (shared) and which are tensors that differ: stacked [n, ...], one row per iteration, or,
    where fewer distinct tensors than calls are passed (Gemma 3's two rotary tables over 26
    layers), the distinct ones stacked once (shared) and an int32 row per iteration picking one.
    Returns (rebuild(rows, shared) -> (args, kwargs), {key: stacked tensor}, {key: shared tensor}):
    the scan body rebuilds the call from its rows and the shared tensors as passed into it."""
    first = group[0]
    kwargs = {k: v for k, v in first.kwargs.items() if k != step_kwarg}
    flat_first, spec = _flatten((first.args, kwargs))
    columns = [_flatten((c.args, {k: v for k, v in c.kwargs.items() if k != step_kwarg}))[0] for c in group]
    varying: dict[str, torch.Tensor] = {}
    shared: dict[str, torch.Tensor] = {}
    for k, leaf in enumerate(flat_first):
        values = [col[k] for col in columns]
        if all(v is leaf for v in values):
            if isinstance(leaf, torch.Tensor):
                shared[f"a{k}"] = leaf
            continue
        if not all(isinstance(v, torch.Tensor) and v.shape == leaf.shape and v.dtype == leaf.dtype for v in values):
            raise ScanError(f"the decoder layers scanned with layer {j} are called with different non-tensor "
                            f"arguments (argument {k}: {type(leaf).__name__})")
        distinct: list[torch.Tensor] = []
        picks = [_index_of(distinct, v) for v in values]
        if len(distinct) < len(values):
            shared[f"t{k}"] = torch.stack(distinct)                       # [u, ...]
            varying[f"a{k}"] = torch.tensor(picks, dtype=torch.int32)     # [n]
        else:
            varying[f"a{k}"] = torch.stack(values)                        # [n, ...]

    def leaf_of(k: int, leaf, rows: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]):
        if f"t{k}" in shared:
            return torch.index_select(shared[f"t{k}"], 0, rows[f"a{k}"].reshape(1))[0]
        return rows.get(f"a{k}", shared.get(f"a{k}", leaf))

    def rebuild(rows: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]):
        return _unflatten([leaf_of(k, leaf, rows, shared) for k, leaf in enumerate(flat_first)], spec)

    return rebuild, varying, shared


def _index_of(distinct: list, value) -> int:
    """The position of `value` (by identity) in `distinct`, appended if it is not there."""
    for i, d in enumerate(distinct):
        if d is value:
            return i
    distinct.append(value)
    return len(distinct) - 1


def _flatten(tree: Any):
    from torch.utils._pytree import tree_flatten
    return tree_flatten(tree)


def _unflatten(leaves, spec):
    from torch.utils._pytree import tree_unflatten
    return tree_unflatten(leaves, spec)
