"""The loader observation (no vLLM needed): fused, TP-sliced, tied and computed loads on a toy model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the mapping observer needs torch (the `test` extra)")

from ulstore.integrations.vllm._mapping import MappingError, observe  # noqa: E402


class Toy(torch.nn.Module):
    """A vLLM-like model, rank ``rank`` of ``tp``: fused qkv (q rows then k rows of this rank), o sliced on dim 1,
    an embedding tied to the head (the checkpoint's ``lm_head.weight`` is skipped), a replicated norm."""

    def __init__(self, tp=1, rank=0, computed=False):
        super().__init__()
        self.tp, self.rank, self.computed = tp, rank, computed
        self.qkv = torch.nn.Parameter(torch.full((12 // tp, 4), 7.0), requires_grad=False)
        self.o = torch.nn.Parameter(torch.full((4, 8 // tp), 7.0), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((6, 4), 7.0), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.full((4,), 7.0), requires_grad=False)

    def load_weights(self, weights):
        q, k, part = 8 // self.tp, 4 // self.tp, self.rank
        for name, w in weights:
            if name == "lm_head.weight":
                continue
            if name == "q":
                src = w.narrow(0, part * q, q)
                if self.computed:
                    src = src * 1  # a computed value
                self.qkv.data[:q].copy_(src)
            elif name == "k":
                self.qkv.data.narrow(0, q, k).copy_(w.narrow(0, part * k, k))
            elif name == "o":
                self.o.data.copy_(w.narrow(1, part * 8 // self.tp, 8 // self.tp))
            elif name == "embed":
                self.embed.data.copy_(w)
            elif name == "norm":
                self.norm.data[...] = w
            else:
                raise KeyError(name)


SPECS = {
    "q": ((8, 4), torch.float32),
    "k": ((4, 4), torch.float32),
    "o": ((4, 8), torch.float32),
    "embed": ((6, 4), torch.float32),
    "lm_head.weight": ((6, 4), torch.float32),
    "norm": ((4,), torch.float32),
}


def _checkpoint():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=g) for n, (shape, _) in SPECS.items()}


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_landings_reproduce_the_loader(tp, rank):
    """Writing every checkpoint tensor through its landings gives what the loader itself writes; observing writes
    nothing."""
    model = Toy(tp, rank)
    lmap = observe(model, SPECS)
    assert all(bool((p == 7).all()) for p in model.parameters())  # the observation wrote nothing
    assert lmap.ignored == ["lm_head.weight"]
    ck = _checkpoint()
    for name, landings in lmap.landings.items():
        for a in landings:
            a.dst(lmap.targets[a.target]).copy_(a.src(ck[name].reshape(-1)))
    expected = Toy(tp, rank)
    expected.load_weights(iter(ck.items()))
    for (n, p), e in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(p, e), n
    # direct views: whole tensors in one contiguous run (the fused q and k rows at TP=1; never a dim-1 slice)
    direct = {n for n, (shape, dt) in SPECS.items() if n in lmap.landings and lmap.direct(n, shape, dt) is not None}
    assert direct == ({"q", "k", "o", "embed", "norm"} if tp == 1 else {"embed", "norm"})
    view = lmap.direct("k", *SPECS["k"]) if tp == 1 else None
    if view is not None:
        view.fill_(3.0)
        assert bool((model.qkv[8:12] == 3).all()) and bool((model.qkv[:8] != 3).all())


def test_a_computed_value_is_refused_by_name():
    with pytest.raises(MappingError, match="computed value.*tensor 'q'"):
        observe(Toy(computed=True), SPECS)


def test_two_tensors_writing_one_element_are_refused():
    class Twice(Toy):
        def load_weights(self, weights):
            for name, w in weights:
                if name in ("embed", "lm_head.weight"):
                    self.embed.data.copy_(w)

    with pytest.raises(MappingError, match="twice"):
        observe(Twice(), SPECS)


def test_a_write_through_an_index_list_is_refused():
    class Gathered(Toy):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "norm":
                    self.norm.data[[0, 2, 1, 3]] = w

    with pytest.raises(MappingError, match="not a slice.*tensor 'norm'"):
        observe(Gathered(), SPECS)


def test_another_in_place_write_is_refused():
    class Filled(Toy):
        def load_weights(self, weights):
            for name, _ in weights:
                if name == "norm":
                    self.norm.data.fill_(1.0)

    with pytest.raises(MappingError, match="fill_.*tensor 'norm'"):
        observe(Filled(), SPECS)
