"""The PEFT building blocks. Each holds one set of weights per adapter name and applies the adapters
the model's PeftState routes to it: to every row of the batch, or (mixed batches) each adapter to
its own rows. Base weights are wrapped in place, never copied.

  PeftLinear     LoRA (y += s * B A x; DoRA: a trained magnitude per output row over the direction W0 + s B A)
                 and (IA)3 (y *= l, or x *= l for the FFN inner activation): a
                 WrappedLinear around the nn.Linear it changes
  BranchAdapter  Houlsby adapters: h + up(act(down(h))) on a residual branch's output (it wraps the branch's
                 output dropout)
  PrefixEncoder  prefix tuning: per-layer key/value prefixes, put in by PrefixSite (Attention.extra_kv)
  SoftPrompt     prompt tuning: n virtual token embeddings, put in by PromptSite (Stack.extra_inputs)
  RoutedHead     adapters' own task heads beside the model's (wraps model.head)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layers import WrappedLinear, dropout

Route = tuple[str, torch.Tensor | None]  # (adapter name, batch rows it applies to; None = every row)

PREFIX_DICT = "peft_prefix"  # the model attribute (an nn.ModuleDict) holding prefix encoders, one per adapter
PROMPT_DICT = "peft_prompt"  # ... holding soft prompts
# every name part that marks a PEFT parameter (module attributes of the classes below and the two dicts above);
# a parameter name holds one of them followed by the adapter name
PEFT_PARTS = ("lora_A", "lora_B", "lora_magnitude", "ia3", "adapters", PREFIX_DICT, PROMPT_DICT, "adapter_heads",
              "trainable_tokens_delta")  # the last: new tokens' rows (peft/new_tokens.py)


class PeftState:
    """Shared by every PEFT module of one model: the adapters it holds (name -> PeftConfig), the
    active ones, and the per-example routing of the current forward (``pretune.peft.route``)."""

    def __init__(self):
        self.configs: dict = {}  # name -> PeftConfig
        self.active: list[str] = []
        self.rows: dict[str, torch.Tensor] | None = None  # mixed batch: name -> row indices
        self.batch_rows: int | None = None  # batch size of the routing
        self.head_configs: dict[str, dict] = {}  # name -> its head fields (head, num_labels, labels, pooling)
        self.owners: dict[str, str] = {}  # base parameter name -> the adapter that trains it (embeddings, biases)

    def routes(self) -> list[Route]:
        if self.rows is None:
            return [(n, None) for n in self.active]
        return list(self.rows.items())

    def owned(self, name: str) -> list[str]:
        """The base parameters adapter ``name`` trains (and saves)."""
        return [k for k, owner in self.owners.items() if owner == name]


def _merge_rows(y: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> torch.Tensor:
    """y + delta on ``rows`` (delta has one row per index), or on every row."""
    if rows is None:
        return y + delta
    return y.index_add(0, rows, delta.to(y.dtype))


class PeftLinear(WrappedLinear):
    """An nn.Linear with LoRA and (IA)3 adapters. ``base_layer`` is the original layer (frozen)."""

    def __init__(self, base: nn.Linear, state: PeftState):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.ia3 = nn.ParameterDict()
        self.lora_magnitude = nn.ParameterDict()  # DoRA: m, the norm of each output row of the adapted weight
        self._dora_norms: dict[str, torch.Tensor] = {}  # DoRA: ||W0 + s B A|| of a merged adapter (to unmerge)
        self.lora_scaling: dict[str, float] = {}
        self.lora_dropout: dict[str, float] = {}
        self.ia3_input = False  # (IA)3 scales the input (FFN inner activation) rather than the output
        self.merged: list[str] = []
        self.state = state

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def fusable(self) -> bool:
        """False while an (IA)3 vector scales this layer's input (the base matmul must see the scaled input)."""
        return not (self.ia3_input and any(n in self.ia3 for n, _ in self.state.routes()))

    def add_lora(self, name: str, r: int, alpha: float, p: float, *, rslora: bool = False) -> None:
        A = nn.Linear(self.in_features, r, bias=False, device=self.weight.device)
        B = nn.Linear(r, self.out_features, bias=False, device=self.weight.device)
        nn.init.kaiming_uniform_(A.weight, a=math.sqrt(5))  # nn.Linear's default, as in Hu et al. / peft
        nn.init.zeros_(B.weight)  # B = 0: the adapted model starts equal to the base model
        self.lora_A[name], self.lora_B[name] = A, B
        self.lora_scaling[name], self.lora_dropout[name] = alpha / (math.sqrt(r) if rslora else r), p

    def add_dora(self, name: str) -> None:
        """Make LoRA adapter ``name`` weight-decomposed (DoRA, Liu et al. 2024): W = m (W0 + s B A) / ||W0 + s B A||
        row by row, m trained and initialised to the rows' norms (so the adapted layer starts equal to the base)."""
        with torch.no_grad():
            self.lora_magnitude[name] = nn.Parameter(self.dora_norm(name).float().clone())

    def dora_norm(self, name: str) -> torch.Tensor:
        """||W0 + s B A|| of every output row, outside the autograd graph (as DoRA §4.3 and peft treat it)."""
        with torch.no_grad():
            w = self.base_layer.weight
            delta = self.lora_B[name].weight @ self.lora_A[name].weight
            return torch.linalg.norm(w.float() + self.lora_scaling[name] * delta.float(), dim=1)

    def dora_delta(self, name: str, x: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
        """What DoRA adds to the base output ``y0 = base_layer(x)``: (m/n - 1) W0 x + (m/n) s B A x (n the row norms
        above); with LoRA dropout in training the W0 x term reads the dropped-out input, as peft computes it."""
        scale = self.lora_magnitude[name] / self.dora_norm(name)  # (out,)
        p = self.lora_dropout[name]
        if p > 0 and self.training:
            x = dropout(x, p, True)
            base = F.linear(x, self.base_layer.weight.to(x.dtype))
        else:
            base = y0 - self.base_layer.bias if self.base_layer.bias is not None else y0
        lora = self.lora_B[name](self.lora_A[name](x)) * self.lora_scaling[name]
        return (scale - 1) * base + scale * lora

    def add_ia3(self, name: str, on_input: bool) -> None:
        n = self.in_features if on_input else self.out_features
        self.ia3[name] = nn.Parameter(torch.ones(n, device=self.weight.device))
        self.ia3_input = on_input

    def remove(self, name: str) -> None:
        for d in (self.lora_A, self.lora_B, self.ia3, self.lora_magnitude):
            if name in d:
                del d[name]
        self.lora_scaling.pop(name, None)
        self.lora_dropout.pop(name, None)

    def lora_delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        x = dropout(x, self.lora_dropout[name], self.training)
        return self.lora_B[name](self.lora_A[name](x)) * self.lora_scaling[name]

    def _scale(self, y: torch.Tensor, routes: list[Route]) -> torch.Tensor:
        """y * l for each routed (IA)3 vector (on its rows)."""
        for name, rows in routes:
            if name not in self.ia3 or name in self.merged:
                continue
            vec = self.ia3[name].to(y.dtype)
            if rows is None:
                y = y * vec
            else:
                scale = torch.ones(y.shape[0], y.shape[-1], dtype=y.dtype, device=y.device)
                scale = scale.index_copy(0, rows, vec.expand(len(rows), -1))
                y = y * scale.view(y.shape[0], *([1] * (y.dim() - 2)), y.shape[-1])
        return y

    def adjust(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The base output ``y = base_layer(x)`` with the routed output-side adapters applied."""
        routes = self.state.routes()
        if not self.ia3_input:
            y = self._scale(y, routes)
        y0 = y
        for name, rows in routes:
            if name in self.lora_A and name not in self.merged:
                xs = x if rows is None else x[rows]
                if name in self.lora_magnitude:
                    delta = self.dora_delta(name, xs, y0 if rows is None else y0[rows])
                else:
                    delta = self.lora_delta(name, xs)
                y = _merge_rows(y, rows, delta)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_in = self._scale(x, self.state.routes()) if self.ia3_input else x
        return self.adjust(x, self.base_layer(x_in))

    # ------------------------------------------------------------------ merge
    def delta_weight(self, name: str) -> torch.Tensor:
        return (self.lora_B[name].weight @ self.lora_A[name].weight) * self.lora_scaling[name]

    @torch.no_grad()
    def merge(self, name: str) -> None:
        """Fold adapter ``name`` into the base weight (W += s B A; (IA)3: scale rows or columns)."""
        if name in self.merged or (name not in self.lora_A and name not in self.ia3):
            return
        W, b = self.base_layer.weight, self.base_layer.bias
        w = W.float()  # computed in fp32 and rounded once to a bf16 base (W itself when W is fp32)
        if name in self.ia3:
            vec = self.ia3[name].float()
            if self.ia3_input:
                w = w * vec[None, :]
            else:
                w = w * vec[:, None]
                if b is not None:
                    b.mul_(vec.to(b.dtype))
        if name in self.lora_magnitude:  # W <- (m / ||W0 + s B A||) (W0 + s B A), row by row
            norm = self.dora_norm(name)
            self._dora_norms[name] = norm
            w = (w + self.delta_weight(name).float()) * (self.lora_magnitude[name] / norm).float()[:, None]
        elif name in self.lora_A:
            w = w + self.delta_weight(name).float()
        W.copy_(w)
        self.merged.append(name)

    @torch.no_grad()
    def unmerge(self, name: str) -> None:
        if name not in self.merged:
            return
        W, b = self.base_layer.weight, self.base_layer.bias
        w = W.float()
        if name in self.lora_magnitude:
            w = w / (self.lora_magnitude[name] / self._dora_norms.pop(name)).float()[:, None]
        if name in self.lora_A:
            w = w - self.delta_weight(name).float()
        if name in self.ia3:
            vec = self.ia3[name].float()
            if self.ia3_input:
                w = w / vec[None, :]
            else:
                w = w / vec[:, None]
                if b is not None:
                    b.div_(vec.to(b.dtype))
        W.copy_(w)
        self.merged.remove(name)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, lora={list(self.lora_A)}, ia3={list(self.ia3)}"
                + (f", dora={list(self.lora_magnitude)}" if self.lora_magnitude else "")
                + (f", merged={self.merged}" if self.merged else ""))


_ACTS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu, "tanh": torch.tanh}


class Bottleneck(nn.Module):
    """down (dim -> dim / reduction) -> nonlinearity -> up (-> dim); up starts at zero, so the adapter
    starts as the identity (Houlsby et al. 2019 use a near-identity initialisation)."""

    def __init__(self, dim: int, reduction_factor: int, act: str):
        super().__init__()
        width = max(1, dim // reduction_factor)
        self.down = nn.Linear(dim, width)
        self.up = nn.Linear(width, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.act_name = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(_ACTS[self.act_name](self.down(h)))  # the residual is added by the caller


class BranchAdapter(nn.Module):
    """Houlsby adapters on one residual branch of one block: wraps the branch's output stage (``inner``, its
    dropout) and adds each routed adapter's bottleneck to what comes out: h + f_name(h), before the residual sum
    (as adapter-transformers place them, after the sublayer's dropout)."""

    def __init__(self, inner: nn.Module, state: PeftState):
        super().__init__()
        self.inner = inner
        self.adapters = nn.ModuleDict()
        self.state = state

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inner(h)
        for name, rows in self.state.routes():
            if name in self.adapters:
                h = _merge_rows(h, rows, self.adapters[name](h if rows is None else h[rows]))
        return h


class PrefixEncoder(nn.Module):
    """Prefix keys/values for every self-attention layer: a trained (L, 2, P, kv_dim) tensor, or, with
    ``projection`` > 0, P embeddings through an MLP (dim -> projection -> L*2*kv_dim) as Li & Liang
    reparametrise for stable training."""

    def __init__(self, n_layers: int, n_virtual: int, kv_dim: int, dim: int, projection: int):
        super().__init__()
        self.shape = (n_layers, 2, n_virtual, kv_dim)
        if projection:
            self.embedding = nn.Parameter(torch.randn(n_virtual, dim) * 0.02)
            self.mlp = nn.Sequential(nn.Linear(dim, projection), nn.Tanh(),
                                     nn.Linear(projection, n_layers * 2 * kv_dim))
            self.prefix = None
        else:
            self.prefix = nn.Parameter(torch.randn(*self.shape) * 0.02)
            self.mlp = None

    @property
    def n_virtual(self) -> int:
        return self.shape[2]

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's (2, P, kv_dim) keys and values. The MLP path computes only that layer's slice of the
        output projection, so no per-forward cache is needed (the loss may call the body directly)."""
        if self.mlp is None:
            return self.prefix[i]
        L, two, P, kv = self.shape
        hidden = self.mlp[1](self.mlp[0](self.embedding))  # (P, projection)
        out = self.mlp[2]
        rows = slice(i * two * kv, (i + 1) * two * kv)  # output units are ordered (layer, k/v, kv_dim)
        y = F.linear(hidden, out.weight[rows], out.bias[rows])  # (P, 2 * kv)
        return y.view(P, two, kv).transpose(0, 1)

    def forward(self) -> torch.Tensor:
        """All layers: (L, 2, P, kv_dim)."""
        return torch.stack([self.layer(i) for i in range(self.shape[0])])


class PrefixSite:
    """Attached to one self-attention module as ``attn.prefix``: prepends the routed adapters'
    key/value prefixes (visible to every query) to the keys and values of that layer."""

    def __init__(self, state: PeftState, encoders: nn.ModuleDict, layer: int, n_kv_heads: int, dh: int):
        self.state, self.encoders, self.layer = state, encoders, layer
        self.n_kv_heads, self.dh = n_kv_heads, dh

    def _kv(self, name: str) -> torch.Tensor:
        return self.encoders[name].layer(self.layer)  # (2, P, kv_dim)

    def __call__(self, k, v, mask, is_causal, Tq):
        routes = [(n, rows) for n, rows in self.state.routes() if n in self.encoders]
        if not routes:
            return k, v, mask, is_causal
        B, Hkv, Tk, Dh = k.shape
        if len(routes) == 1 and routes[0][1] is None:  # one prefix for the whole batch
            kv = self._kv(routes[0][0]).to(k.dtype)
            P = kv.shape[1]
            pk, pv = (t.view(1, P, Hkv, Dh).transpose(1, 2).expand(B, -1, -1, -1) for t in kv)
            col_mask = None
        else:  # mixed batch: each row's prefix right-aligned in P_max slots, unused slots hidden
            P = max(self.encoders[n].n_virtual for n, _ in routes)
            pk = k.new_zeros(B, Hkv, P, Dh)
            pv = v.new_zeros(B, Hkv, P, Dh)
            visible = torch.zeros(B, P, dtype=torch.bool, device=k.device)
            for name, rows in routes:
                kv = self._kv(name).to(k.dtype)
                p = kv.shape[1]
                rows = torch.arange(B, device=k.device) if rows is None else rows
                pk[rows, :, P - p:] = kv[0].view(p, Hkv, Dh).transpose(0, 1)
                pv[rows, :, P - p:] = kv[1].view(p, Hkv, Dh).transpose(0, 1)
                visible[rows, P - p:] = True
            col_mask = torch.zeros(B, 1, 1, P, device=k.device).masked_fill(~visible[:, None, None, :],
                                                                             torch.finfo(torch.float32).min)
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        if mask is None and not is_causal and col_mask is None:
            return k, v, None, False
        if mask is None:
            mask = torch.zeros(1, 1, Tq, Tk, device=k.device)
            if is_causal:
                hidden = torch.ones(Tq, Tk, dtype=torch.bool, device=k.device).triu_(Tk - Tq + 1)
                mask = mask.masked_fill(hidden, torch.finfo(mask.dtype).min)
        cols = col_mask if col_mask is not None else mask.new_zeros(1, 1, 1, P)  # (1|B, 1, 1, P)
        b, h = max(mask.shape[0], cols.shape[0]), mask.shape[1]
        cols = cols.to(mask.dtype).expand(b, h, mask.shape[2], P)
        return k, v, torch.cat([cols, mask.expand(b, h, -1, -1)], dim=-1), False


class SoftPrompt(nn.Module):
    """n_virtual trainable input embeddings (prompt tuning)."""

    def __init__(self, n_virtual: int, dim: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.zeros(n_virtual, dim))

    @property
    def n_virtual(self) -> int:
        return self.embedding.shape[0]


class PromptSite:
    """Attached to the input stack as ``stack.prompt``: prepends the routed soft prompts to the token
    embeddings (right-aligned in P_max slots in a mixed batch, unused slots masked), extends the
    attention mask, token types and positions, and tells the stack how many positions to strip."""

    def __init__(self, state: PeftState, prompts: nn.ModuleDict):
        self.state, self.prompts = state, prompts

    def __call__(self, x, attention_mask, token_type_ids, position_ids, past):
        routes = [(n, rows) for n, rows in self.state.routes() if n in self.prompts]
        if not routes:
            return x, attention_mask, token_type_ids, position_ids, 0
        B, T, _ = x.shape
        dev = x.device
        P = max(self.prompts[n].n_virtual for n, _ in routes)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)  # each row's prompt length
        for name, rows in routes:
            lengths[slice(None) if rows is None else rows] = self.prompts[name].n_virtual
        single = len(routes) == 1 and routes[0][1] is None
        if past == 0 and single and attention_mask is None and position_ids is None:  # the plain case
            prompt = self.prompts[routes[0][0]].embedding.to(x.dtype)
            x = torch.cat([prompt.expand(B, -1, -1), x], dim=1)
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (P, 0))
            return x, None, token_type_ids, None, P
        real_past = past - P if past else 0
        if position_ids is None:
            position_ids = torch.arange(real_past, real_past + T, device=dev)
        position_ids = position_ids.expand(B, T) + lengths[:, None]  # real tokens follow their prompt
        slots = torch.arange(P, device=dev)
        visible = slots[None, :] >= (P - lengths)[:, None]  # (B, P): the row's prompt is right-aligned
        if attention_mask is None:
            attention_mask = torch.ones(B, real_past + T, dtype=torch.long, device=dev)
        if attention_mask.shape[1] == real_past + T:  # the caller's mask covers the real tokens only
            attention_mask = torch.cat([visible.to(attention_mask.dtype), attention_mask], dim=1)
        if past:  # incremental decoding: the prompt is already in the cache
            return x, attention_mask, token_type_ids, position_ids, 0
        prompt = x.new_zeros(B, P, x.shape[-1])
        for name, rows in routes:
            emb = self.prompts[name].embedding.to(x.dtype)
            p = emb.shape[0]
            if rows is None:
                prompt[:, P - p:] = emb
            else:
                prompt[rows, P - p:] = emb
        virtual_pos = (slots[None, :] - (P - lengths)[:, None]).clamp(min=0)
        x = torch.cat([prompt, x], dim=1)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (P, 0))
        return x, attention_mask, token_type_ids, torch.cat([virtual_pos, position_ids], dim=1), P


class RoutedHead(nn.Module):
    """The model's task head (``base``) with adapters' own task heads beside it (``adapter_heads``, loaded with
    their adapters): on the rows routed to an adapter that has a head, that head's output replaces the base
    head's. Wraps ``model.head`` the way peft's ``modules_to_save`` wraps a module."""

    def __init__(self, base: nn.Module, state: PeftState):
        super().__init__()
        self.base = base
        self.adapter_heads = nn.ModuleDict()
        self.state = state

    def forward(self, h, attention_mask=None, pooled=None, input_ids=None):
        logits = self.base(h, attention_mask, pooled, input_ids=input_ids)  # input_ids: BART pools at each row's EOS
        for name, rows in self.state.routes():
            if name not in self.adapter_heads:
                continue
            head = self.adapter_heads[name]
            if rows is None:
                logits = head(h, attention_mask, pooled, input_ids=input_ids)
                continue
            out = head(h[rows], None if attention_mask is None else attention_mask[rows],
                       None if pooled is None else pooled[rows],
                       input_ids=None if input_ids is None else input_ids[rows])
            if out.shape[1:] != logits.shape[1:]:
                raise ValueError(f"adapter {name!r}'s head gives outputs of shape {tuple(out.shape[1:])}, the "
                                 f"batch's other rows {tuple(logits.shape[1:])}: a mixed batch needs equal heads")
            logits = logits.index_copy(0, rows, out.to(logits.dtype))
        return logits
