"""Session 9 check (GPU): test_models' maskformer-bf16 failure (conv weight gradients of the FPN 2.5x
farther from the float64 truth patched than unpatched). Per GroupNorm of the model: dx's error from
the truth for torch's CUDA kernel and normkit's, and dx's strides; per conv before a GroupNorm: the
weight gradient's error when it is fed torch's dx, normkit's dx, and normkit's dx made contiguous."""
import copy
import sys

import torch

sys.path.insert(0, "tests")
import normkit  # noqa: E402
import normkit.reference as ref  # noqa: E402
import test_models as tm  # noqa: E402

fam = tm.FAMILIES["maskformer"]
base = fam.build()
tm._randomize_norm_params(base, [n for n, m in base.named_modules() if type(m).__name__ in fam.norms],
                          fam.weight_center)
cap = {}


class Cap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, name):
        ctx.name = name
        return o.clone()

    @staticmethod
    def backward(ctx, g):
        cap[ctx.name]["dy"] = g.detach().clone()
        return g, None


def fhook(name):
    def f(m, i, o):
        if name in cap:  # the first (training) run's tensors only
            return None
        cap[name] = {"x": i[0].detach().clone(), "m": m}
        return Cap.apply(o, name)
    return f


dev = "cuda" if torch.cuda.is_available() else "cpu"
m = copy.deepcopy(base).to(dev, torch.bfloat16)
names = [n for n, mod in m.named_modules() if type(mod).__name__ == "GroupNorm"]
for n in names:
    m.get_submodule(n).register_forward_hook(fhook(n))
raw = fam.inputs(torch.Generator().manual_seed(2))
b = {k: v.to(dev, torch.bfloat16) for k, v in raw.items()}
out, loss = fam.run(m, b)
loss.backward()


def grads(x, dy, w, bb, fn):
    x, w, bb = (t.clone().requires_grad_() for t in (x, w, bb))
    fn(x, w, bb).backward(dy)
    return x.grad, w.grad


for n in names:
    c = cap[n]
    mod, x, dy = c["m"], c["x"], c["dy"]
    G, eps = mod.num_groups, mod.eps
    w, bias = mod.weight.detach(), mod.bias.detach()
    t = grads(x.double(), dy.double(), w.double(), bias.double(), lambda x, w, b: torch.nn.functional.group_norm(x, G, w, b, eps))
    tb = grads(x, dy, w, bias, lambda x, w, b: torch.nn.functional.group_norm(x, G, w, b, eps))
    nk = grads(x, dy, w, bias, lambda x, w, b: normkit.group_norm(x, G, w, b, eps))
    print(f"{n} {tuple(x.shape)} x strides {x.stride()} dy strides {dy.stride()}: dx err torch {ref.rel_err(tb[0], t[0]):.3g} "
          f"normkit {ref.rel_err(nk[0], t[0]):.3g}; dx strides torch {tb[0].stride()} normkit {nk[0].stride()}; "
          f"dx sum per group (should be ~0) torch {tb[0].float().reshape(x.shape[0], G, -1).sum(-1).abs().max().item():.3g} "
          f"normkit {nk[0].float().reshape(x.shape[0], G, -1).sum(-1).abs().max().item():.3g}")
    # the conv before this norm: its weight gradient from each dx
    parent = m.get_submodule(n.rsplit(".", 1)[0])
    conv = parent[0] if isinstance(parent, torch.nn.Sequential) else None
    if isinstance(conv, torch.nn.Conv2d):
        inp = {}
        h = conv.register_forward_hook(lambda mm, i, o: None if "x" in inp else inp.update(x=i[0].detach().clone()))
        with torch.no_grad():
            fam.run(m, b)
        h.remove()
        cin = inp["x"]

        def wgrad(g, cin=cin, conv=conv):
            wt = conv.weight.detach().clone().requires_grad_()
            y = torch.nn.functional.conv2d(cin, wt, None if conv.bias is None else conv.bias.detach(), conv.stride,
                                           conv.padding, conv.dilation, conv.groups)
            y.backward(g.to(y.dtype))
            return wt.grad
        wt = conv.weight.detach().double().clone().requires_grad_()
        y = torch.nn.functional.conv2d(cin.double(), wt, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        y.backward(t[0])
        truth = wt.grad
        print(f"   conv weight grad err from: truth dx rounded to bf16 {ref.rel_err(wgrad(t[0].to(torch.bfloat16)), truth):.3g}, "
              f"torch dx {ref.rel_err(wgrad(tb[0]), truth):.3g}, normkit dx {ref.rel_err(wgrad(nk[0]), truth):.3g}, "
              f"normkit dx contiguous {ref.rel_err(wgrad(nk[0].contiguous()), truth):.3g}, "
              f"torch dx channels_last {ref.rel_err(wgrad(tb[0].contiguous(memory_format=torch.channels_last)), truth):.3g}")
