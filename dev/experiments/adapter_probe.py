"""What a cross-model AV's injection adapter keeps of the subject's vector (issue 24).

The world probe (``nla.world.probe``: one logistic probe per fact kind, fitted on 1,500 training
stories, top-1 on 300 held-out ones) read from: the subject's layer-K vectors; the AV base's own
vectors at layers 0..K; the subject's vectors through a trained AV's adapter; and through two
starts of the adapter fitted here on the same rows: the ridge translation onto the base's layer K
(``InjectionAdapter.fit``, what ``nla train av`` does) and the top-d_out principal directions
rotated onto it (orthogonal Procrustes: keeps the most variance a d_out-wide map can).

    python -m dev.experiments.adapter_probe SUBJECT_DIR AV_BASE_DIR AV_CHECKPOINT [--layer 2]

e.g. the default world's subject, the default-d64 world's subject, and a cross-model run's
``av/checkpoints/step_*``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("subject", help="the subject's HF dir (a world's subject/)")
    ap.add_argument("base", help="the AV's base HF dir (another world's subject/)")
    ap.add_argument("av", help="a trained cross-model AV checkpoint (with nla_injection_adapter.safetensors)")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the world's seed (its stories)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.core.injection import InjectionAdapter, load_adapter_file
    from nla.core.sidecar import load_sidecar
    from nla.core.vectors import normalize_activation
    from nla.world.build import WORLD_PRESETS
    from nla.world.generator import generate_documents
    from nla.world.probe import collect_layer_vectors, probe_kinds

    torch.set_num_threads(1)
    n_docs = WORLD_PRESETS["default"].n_docs
    train = generate_documents(args.seed, 1500)
    test = generate_documents(args.seed, 300, start_id=n_docs)

    def vectors(model_dir: str, layers: list[int]):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        return (collect_layer_vectors(model, tok, train, layers, seed=0),
                collect_layer_vectors(model, tok, test, layers, seed=1))

    def show(name: str, x_tr: np.ndarray, x_te: np.ndarray) -> None:
        res = probe_kinds(x_tr, f_tr, x_te, f_te)
        cells = " ".join(f"{k.kind} {k.top1:.2f}" for k in res)
        print(f"{name:34s} {cells}  mean {np.mean([k.top1 for k in res]):.3f}", flush=True)

    k = args.layer
    (s_tr, f_tr), (s_te, f_te) = vectors(args.subject, [k])
    show(f"subject layer {k}", s_tr[k], s_te[k])
    (o_tr, _), (o_te, _) = vectors(args.base, list(range(k + 1)))
    for j in range(k + 1):
        show(f"AV base's own layer {j}", o_tr[j], o_te[j])
    side = load_sidecar(args.av)
    scale = side.injection_scale_value()
    trained = load_adapter_file(args.av, side)
    src_tr = normalize_activation(torch.from_numpy(s_tr[k]).float(), scale)
    src_te = normalize_activation(torch.from_numpy(s_te[k]).float(), scale)
    with torch.no_grad():
        show("trained adapter(subject)", trained(src_tr).numpy(), trained(src_te).numpy())
        d_in, d_out = trained.d_in, trained.d_out
        tgt = normalize_activation(torch.from_numpy(o_tr[k]).float(),
                                   None if scale is None else scale * (d_out / d_in) ** 0.5)
        ridge = InjectionAdapter(d_in, d_out)
        r2 = ridge.fit(src_tr, tgt)
        show(f"ridge start (R^2 {r2:.2f})", ridge(src_tr).numpy(), ridge(src_te).numpy())
        # top-d_out principal directions of the source, rotated onto the target (orthogonal Procrustes)
        s, t = src_tr.double(), tgt.double()
        sm, tm = s.mean(0), t.mean(0)
        _, _, vt = torch.linalg.svd(s - sm, full_matrices=False)
        p = vt[: min(d_in, d_out)]
        u, _, wt = torch.linalg.svd(((s - sm) @ p.T).T @ (t - tm), full_matrices=False)
        w = (p.T @ (u @ wt)).T
        w = w * ((t - tm).norm() / ((s - sm) @ w.T).norm())  # at the target's spread
        pred = (s - sm) @ w.T
        r2p = 1 - float(((pred - (t - tm)) ** 2).sum() / ((t - tm) ** 2).sum())
        show(f"principal + Procrustes (R^2 {r2p:.2f})", pred.float().numpy(), ((src_te.double() - sm) @ w.T).float().numpy())


if __name__ == "__main__":
    main()
