"""Broken copies of a good BD adapter for the plugin's refusal tests (offline engine and OpenAI server)."""

from __future__ import annotations


def make_bad_adapters(good_bd2: str, too_big: str, root) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """Broken copies of a good BD adapter (nblocks=2, r=8, on the tests' tiny Llama: q_proj 256 x 256) for refusal
    tests: [(name, path, expected HTTP status, substrings the message must contain, also after the OpenAI server
    replaced file paths in it by "<path>")]. ``too_big``: an adapter that
    does not fit the engine's per-device buffers (a dense r=16 one at TP=2, max_lora_rank 16)."""
    import json
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = str(root)
    cfg_name, w_name = "adapter_config.json", "adapter_model.safetensors"

    def copy(name):
        dst = os.path.join(root, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(good_bd2, dst)
        return dst

    out = []
    p = copy("bad-json")  # a hand-edited config with a trailing comma
    with open(os.path.join(p, cfg_name)) as f:
        text = f.read()
    with open(os.path.join(p, cfg_name), "w") as f:
        f.write(text.rstrip().rstrip("}") + ', }')
    out.append(("bad-json", p, 400, ("bad-json", cfg_name, "JSON")))
    p = copy("truncated")  # an interrupted copy
    w = os.path.join(p, w_name)
    size = os.path.getsize(w)
    with open(w, "r+b") as f:
        f.truncate(size // 2)
    out.append(("truncated", p, 400, ("truncated", w_name, "truncated or corrupt")))
    p = copy("wrong-shape")  # q_proj's B of another model (d_out 384 instead of 256)
    tensors = load_file(os.path.join(p, w_name))
    for k in list(tensors):
        if "layers.0.self_attn.q_proj.lora_B" in k:
            b = tensors[k]
            tensors[k] = torch.cat([b, b[: b.shape[0] // 2]])
    save_file(tensors, os.path.join(p, w_name))
    out.append(("wrong-shape", p, 400, ("wrong-shape", w_name, "model.layers.0.self_attn.q_proj", "384 x 256",
                                        "256 x 256", "trained for another model")))
    missing = os.path.join(root, "does-not-exist")
    out.append(("missing", missing, 404, ("missing", "No adapter found")))
    p = copy("nblocks3")
    with open(os.path.join(p, cfg_name)) as f:
        cfg = json.load(f)
    cfg["r"], cfg["use_bdlora"]["nblocks"] = 6, 3
    with open(os.path.join(p, cfg_name), "w") as f:
        json.dump(cfg, f)
    out.append(("nblocks3", p, 400, ("nblocks3", "nblocks=3 but tensor-parallel size is 2")))
    out.append(("too-big", str(too_big), 400, ("too-big", "needs rank 16 on each of the 2 devices")))
    p = copy("no-config")
    os.remove(os.path.join(p, cfg_name))
    out.append(("no-config", p, 400, ("no-config", cfg_name)))
    p = copy("ghost")  # module names of a deeper model
    tensors = load_file(os.path.join(p, w_name))
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}, os.path.join(p, w_name))
    out.append(("ghost", p, 400, ("ghost", "do not exist in the base model")))
    out.append(("a-file", os.path.join(good_bd2, w_name), 400, ("a-file", "is a file")))
    return out
