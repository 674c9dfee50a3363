"""Several optimizers over disjoint parameters of one model (a GAN), against the DDP oracle.

The model has the shape of Lightning's GAN example (``domain_templates/
generative_adversarial_net.py``): an MLP generator from a latent vector to an image, an MLP
discriminator (with dropout here) from an image to a logit, one Adam for each. Each step trains
the generator through the discriminator, then the discriminator on real and detached fake
images, as a manual-optimization ``training_step`` does:

- ``toggle``: the other optimizer's parameters have ``requires_grad=False`` during each half
  (Lightning's ``toggle_optimizer``);
- without it, the generator's backward leaves gradients in the discriminator too, and the
  discriminator's step uses them added to its own (``opt_g.zero_grad()`` must not clear them);
- ``joint``: one backward of both losses, then each optimizer clips (by its own norm) and steps;
- ``clip``: the discriminator's gradients are clipped by their norm over its parameters
  (``opt_d.clip_grad_norm_``; DDP: ``torch.nn.utils.clip_grad_norm_(D.parameters())``), and in
  ``joint`` the generator's by theirs, while both hold gradients.

One launch on 2 ranks runs every cell (stages 1-3, ZeRO-3 with units really freed, CPU
offload), a checkpoint resume (saved at ZeRO-2, resumed at ZeRO-3) and the refusals; a second
launch on 3 ranks loads the world-2 checkpoint (resharded) and checks every optimizer's state."""

from __future__ import annotations

from pathlib import Path

from zero_strategy.testing import assert_close, run_subtests, subtest_grid

LATENT, IMG, HID = 8, 12, 16


def _gan():
    """The GAN module (built in the worker: classes are not pickled across processes)."""
    from torch import nn

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(
                nn.Linear(LATENT, HID), nn.LeakyReLU(0.2), nn.Linear(HID, HID), nn.LeakyReLU(0.2),
                nn.Linear(HID, IMG), nn.Tanh(),
            )  # fmt: skip

        def forward(self, z):
            return self.model(z)

    class Discriminator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(
                nn.Linear(IMG, HID), nn.LeakyReLU(0.2), nn.Dropout(0.25), nn.Linear(HID, 1),
            )  # fmt: skip

        def forward(self, img):
            return self.model(img)

    class GAN(nn.Module):
        """``forward(z)`` scores generated images (the generator's half); ``forward(z, real)``
        scores real and detached generated images (the discriminator's half)."""

        def __init__(self) -> None:
            super().__init__()
            self.generator = Generator()
            self.discriminator = Discriminator()

        def forward(self, z, real=None, joint=False):
            fake = self.generator(z)
            if real is None:
                return self.discriminator(fake)
            if joint:  # both halves' logits from one forward, for one backward
                return self.discriminator(fake), self.discriminator(real), self.discriminator(fake.detach())
            return self.discriminator(real), self.discriminator(fake.detach())

    return GAN, (Generator, Discriminator)


def _batch(step: int, rank: int, n: int = 6):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    z = torch.randn(n, LATENT, generator=g, dtype=torch.float64)
    real = torch.rand(n, IMG, generator=g, dtype=torch.float64) * 2 - 1
    return z, real


def _optimizers(model):
    import torch

    return (
        torch.optim.Adam(model.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999), weight_decay=0.01),
    )


def _run(net, model, opt_g, opt_d, steps: range, rank: int, *, toggle: bool, clip: float | None,
         ddp: bool, joint: bool = False, torch_clip: bool = False) -> list[float]:  # fmt: skip
    """The GAN's training steps; the generator's and the discriminator's losses, and the
    discriminator's gradient norm when clipping (``torch_clip``: the ZeRO run clips as the DDP
    one does, with ``torch.nn.utils.clip_grad_norm_`` over one half's parameters)."""
    import torch
    import torch.nn.functional as F

    def clip_(opt, params, max_norm):
        plain = ddp or torch_clip
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if plain else opt.clip_grad_norm_(max_norm)
        out.append(float(norm))

    out: list[float] = []
    for step in steps:
        z, real = _batch(step, rank)
        ones, zeros = torch.ones(len(z), 1, dtype=torch.float64), torch.zeros(len(z), 1, dtype=torch.float64)
        torch.manual_seed(10 * step + rank)  # the same dropout masks in both runs
        if joint:
            fake_g, real_logit, fake_logit = net(z, real, joint=True)
            g_loss = F.binary_cross_entropy_with_logits(fake_g, ones)
            d_loss = (F.binary_cross_entropy_with_logits(real_logit, ones)
                      + F.binary_cross_entropy_with_logits(fake_logit, zeros)) / 2  # fmt: skip
            (g_loss + d_loss).backward()
            if clip is not None:
                clip_(opt_d, model.discriminator.parameters(), clip)
                clip_(opt_g, model.generator.parameters(), 2 * clip)
            opt_g.step()
            opt_g.zero_grad()
            opt_d.step()
            opt_d.zero_grad()
            out += [g_loss.item(), d_loss.item()]
            continue
        if toggle:
            model.discriminator.requires_grad_(False)
        g_loss = F.binary_cross_entropy_with_logits(net(z), ones)
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        if toggle:
            model.discriminator.requires_grad_(True)
            model.generator.requires_grad_(False)
        real_logit, fake_logit = net(z, real)
        d_loss = (F.binary_cross_entropy_with_logits(real_logit, ones)
                  + F.binary_cross_entropy_with_logits(fake_logit, zeros)) / 2  # fmt: skip
        d_loss.backward()
        if clip is not None:
            clip_(opt_d, model.discriminator.parameters(), clip)
        opt_d.step()
        opt_d.zero_grad()
        if toggle:
            model.generator.requires_grad_(True)
        out += [g_loss.item(), d_loss.item()]
    return out


def _state(model, zero: bool) -> dict:
    import torch

    import zero_strategy as zs

    with zs.gathered_parameters(model) if zero else torch.no_grad():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_reference(rank: int, steps: int, *, toggle: bool, clip: float | None, joint: bool = False):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    GAN, _ = _gan()
    torch.manual_seed(0)
    model = GAN().double()
    opt_g, opt_d = _optimizers(model)
    net = DDP(model, find_unused_parameters=True)  # each half leaves the other's parameters unused
    values = _run(net, model, opt_g, opt_d, range(steps), rank, toggle=toggle, clip=clip, ddp=True, joint=joint)
    return model, (opt_g, opt_d), values


def _zero_model(stage: int, **overrides):
    import torch

    import zero_strategy as zs

    GAN, classes = _gan()
    torch.manual_seed(0)
    model = GAN().double()
    policy = set(classes) if stage == 3 else None
    model, opts = zs.initialize(model, list(_optimizers(model)), stage=stage, policy=policy, **overrides)
    return model, opts


def case_gan(
    rank: int,
    world: int,
    stage: int,
    toggle: bool,
    clip: float | None,
    overrides: dict,
    joint: bool = False,
    torch_clip: bool = False,
) -> None:
    """Two optimizers, manual-optimization order, equal to DDP (losses, clipped norms, weights);
    at ZeRO-1/2 the steps of one iteration all-gather the model's parameters once between them."""
    import zero_strategy as zs

    ref, _, ref_values = _ddp_reference(rank, 4, toggle=toggle, clip=clip, joint=joint)
    model, (opt_g, opt_d) = _zero_model(stage, **overrides)
    zs.reset_comm_stats()
    values = _run(model, model, opt_g, opt_d, range(4), rank, toggle=toggle, clip=clip, ddp=False, joint=joint,
                  torch_clip=torch_clip)  # fmt: skip
    what = f"stage {stage} toggle={toggle} clip={clip} joint={joint} torch_clip={torch_clip} {overrides}"
    if stage < 3:  # each step gathers its own optimizer's parameters: the whole model once per iteration
        gathered = sum(v["bytes"] for k, v in zs.comm_stats().items() if "gather" in k)
        params = model.zero_engine.params
        once = sum(world * g.layout.shard_numel * g.params[0].element_size() for g in params.groups)
        assert gathered == 4 * once, f"{what}: {gathered} bytes gathered in 4 iterations, expected 4 x {once}"
    assert model.zero_engine.step_count == 4, f"{what}: {model.zero_engine.step_count} model steps counted, not 4"
    assert_close(values, ref_values, rtol=1e-9, atol=1e-12, what=f"{what} losses")
    got = _state(model, True)
    for k, v in _state(ref, False).items():
        assert_close(got[k], v, rtol=1e-7, atol=1e-12, what=f"{what} {k}")
    if overrides.get("stage3_param_persistence_threshold") == 0:  # the units were really freed between uses
        assert all(not u.persistent for u in model.zero_engine.params.units)
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())


def case_resume(rank: int, world: int, root: str) -> None:
    """Two steps at ZeRO-2, a checkpoint of both optimizers, two more steps from it at ZeRO-3
    in a fresh model: equal to four DDP steps (Adam's moments and steps survived)."""
    import zero_strategy as zs

    ref, ref_opts, ref_values = _ddp_reference(rank, 4, toggle=True, clip=None)
    model, (opt_g, opt_d) = _zero_model(2)
    first = _run(model, model, opt_g, opt_d, range(2), rank, toggle=True, clip=None, ddp=False)
    zs.save_checkpoint(root, model, [opt_g, opt_d], extra=_reference_after(rank, 2))
    fresh, (g2, d2) = _zero_model(3)
    zs.load_checkpoint(root, fresh, [g2, d2])
    rest = _run(fresh, fresh, g2, d2, range(2, 4), rank, toggle=True, clip=None, ddp=False)
    assert_close(first + rest, ref_values, rtol=1e-9, atol=1e-12, what="resumed losses")
    got = _state(fresh, True)
    for k, v in _state(ref, False).items():
        assert_close(got[k], v, rtol=1e-7, atol=1e-12, what=f"resumed {k}")
    # one optimizer where two were saved: refused with the count
    try:
        zs.load_checkpoint(root, fresh, g2)
    except ValueError as exc:
        assert "the model trains with 2 optimizer(s) and 1 were given" in str(exc), exc
    else:
        raise AssertionError("loading two optimizers' checkpoint into one optimizer did not raise")


def _reference_after(rank: int, steps: int) -> dict:
    """DDP's weights and Adam moments after ``steps`` steps, by name (for the world-3 reload)."""
    ref, (opt_g, opt_d), _ = _ddp_reference(rank, steps, toggle=True, clip=None)
    names = {id(p): n for n, p in ref.named_parameters()}
    out = {f"model.{k}": v.reshape(-1).tolist() for k, v in _state(ref, False).items()}
    for opt in (opt_g, opt_d):
        for p, st in opt.state.items():
            out[f"optim.{names[id(p)]}.exp_avg_sq"] = st["exp_avg_sq"].reshape(-1).tolist()
            out[f"optim.{names[id(p)]}.step"] = [float(st["step"])]
    return out


def case_refusals(rank: int, world: int) -> None:
    """A parameter in two optimizers; several optimizers with fp16 loss scaling; stepping an
    optimizer that was not bound."""
    import torch

    import zero_strategy as zs

    GAN, _ = _gan()
    for opts, overrides, words in (
        (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.discriminator.parameters(), lr=0.1)],
         {}, "parameter 'discriminator.model.0.weight' is in optimizers 0 and 1"),
        (lambda m: list(_optimizers(m)), {"precision": "fp16"}, "fp16 loss scaling"),
        (lambda m: list(_optimizers(m)), {"compression": {"type": "topk", "ratio": 0.5}}, "compression type 'topk'"),
    ):  # fmt: skip
        model = GAN().double() if "precision" not in overrides else GAN()
        try:
            zs.initialize(model, opts(model), stage=2, **overrides)
        except ValueError as exc:
            assert words in str(exc), exc
            assert getattr(model, "zero_engine", None) is None  # refused before anything changed
        else:
            raise AssertionError(f"initialize did not refuse: {words}")


# --------------------------------------------------------------------------- launches


def _world2(rank: int, world: int, root: str) -> bool:
    grid = [
        *subtest_grid(stage=[1, 2, 3], toggle=[True, False], clip=[None], overrides=[{}]),
        {"stage": 2, "toggle": False, "clip": 0.05, "overrides": {}},
        *subtest_grid(stage=[1, 3], toggle=[False], clip=[0.05], overrides=[{}], joint=[True]),
        {"stage": 3, "toggle": True, "clip": 0.05, "overrides": {"stage3_param_persistence_threshold": 0}},
        {"stage": 1, "toggle": True, "clip": None, "overrides": {"offload_optimizer": {"device": "cpu"}}},
        # torch.nn.utils.clip_grad_norm_ over one half's parameters: that optimizer's global clip
        {"stage": 2, "toggle": True, "clip": 0.05, "overrides": {}, "torch_clip": True},
        {"stage": 3, "toggle": False, "clip": 0.05, "overrides": {}, "joint": True, "torch_clip": True},
    ]
    run_subtests(lambda **kw: case_gan(rank, world, **kw), grid, label="gan")
    case_resume(rank, world, root)
    case_refusals(rank, world)
    return True


def _world3(rank: int, world: int, root: str) -> bool:
    """The world-2 checkpoint of both optimizers, resharded onto 3 ranks at ZeRO-1: the weights
    and each optimizer's Adam state equal DDP's after the same two steps."""
    import torch

    import zero_strategy as zs

    model, opts = _zero_model(1)
    extra = zs.load_checkpoint(root, model, opts)
    got = {f"model.{k}": v for k, v in _state(model, True).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in opts:
        for group in opt.param_groups:
            for m in group["params"]:
                p = next(p for p in model.parameters() if model.zero_engine.master_of(p) is m)
                st, n = opt.state[m], names[id(p)]
                got[f"optim.{n}.step"] = st["step"].reshape(1)
                g, i = model.zero_engine.reducer.locate(p)
                lo, hi = g.layout.local_range(i)
                ref = torch.tensor(extra[f"optim.{n}.exp_avg_sq"], dtype=torch.float64)[lo:hi]
                if hi == lo:  # this rank holds no piece of it (a 1-element bias on 3 ranks)
                    continue
                assert_close(st["exp_avg_sq"], ref, rtol=1e-7, atol=1e-15, what=f"world 3 {n} exp_avg_sq")
    checked = 0
    for key, value in got.items():
        assert_close(value.reshape(-1), extra[key], rtol=1e-7, atol=1e-12, what=f"world 3 {key}")
        checked += 1
    return checked > 0


def test_gan_equals_ddp(launch, tmp_path: Path) -> None:
    root = str(tmp_path / "gan")
    assert all(launch(_world2, 2, args=(root,), timeout=600))
    assert all(launch(_world3, 3, args=(root,), timeout=600))
