"""Start-up checks: what would stop `tokenloop serve`, found before anything loads, each named with its flag.

`check_startup(config)` runs first in `tokenloop serve` (before the port opens or the model loads) and raises
`StartupError` with one sentence: what is wrong, and the flag or path to fix. The CLI prints it and exits 2.
Order: the model directory (exists, config.json, tokenizer.json, readable weights, a supported architecture for
the embedded engine) or GGUF file (core/gguf_file.py's refusals), the `--lora` adapter directories, then TLS files,
the API-key and admin-key files, the `--lora-root` directories, the ports, and for `--backend trtllm` that
TensorRT-LLM is installed.
"""

from __future__ import annotations

import errno
import json
import socket
import ssl
from pathlib import Path

from tokenloop.core.gguf_file import GGUFError, is_gguf

from .config import DEFAULT_MODEL_DIR, ServerConfig

MAKE_MODEL_HINT = " (run `make model` to prepare the default model)"


class StartupError(Exception):
    """tokenloop serve cannot start: the message names what is wrong and the flag or path to fix."""


def check_startup(config: ServerConfig) -> None:
    """Every check, in order; raises StartupError on the first failure."""
    check_model_dir(Path(config.model), config.backend)
    check_lora_dirs(config.loras)
    check_tls(config.tls_cert, config.tls_key, config.tls_client_ca)
    check_api_key_file(config.api_key_file)
    check_api_key_file(config.admin_key_file, "--admin-key-file")
    check_lora_roots(config.lora_roots)
    check_listen(config.host, config.port, "--port")
    if config.metrics_port:
        check_listen(config.host, config.metrics_port, "--metrics-port")
    if config.backend == "trtllm":
        check_trtllm_installed()


def check_lora_dirs(loras: tuple[str, ...]) -> None:
    """Each `--lora NAME=DIR` names a PEFT adapter directory (its contents are checked when it loads)."""
    from .config import parse_lora_flag

    for value in loras:
        name, path = parse_lora_flag(value)
        where = Path(path)
        if not where.is_dir():
            raise StartupError(f"--lora {name}={path}: no such directory")
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            if not (where / file).is_file():
                raise StartupError(f"--lora {name}={path}: not a PEFT adapter (no {file})")


def check_trtllm_installed() -> None:
    """--backend trtllm needs the tensorrt_llm package (found, not imported: that takes seconds and a GPU)."""
    from .executors import trtllm_missing

    missing = trtllm_missing()
    if missing:
        raise StartupError(missing)


# -- the model directory -------------------------------------------------------------------
def check_model_dir(path: Path, backend: str) -> None:
    """A checkpoint directory tokenloop can serve with `backend`."""
    where = f"--model {path}"
    hint = MAKE_MODEL_HINT if path.resolve() == DEFAULT_MODEL_DIR.resolve() else ""
    if not path.exists():
        raise StartupError(f"{where}: no such file or directory{hint}")
    if is_gguf(path):
        check_gguf(path, backend)
        return
    if not path.is_dir():
        raise StartupError(f"{where}: neither a checkpoint directory (config.json, tokenizer.json, weights) nor a "
                           "GGUF file (*.gguf)")
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as exc:
        raise StartupError(f"{where}: cannot list the directory ({exc.strerror})") from None
    if "config.json" not in names:
        raise StartupError(f"{where}: no config.json; expected a Hugging Face checkpoint directory{hint}")
    config = _read_json(path / "config.json", where)
    _check_tokenizer(path, where, "tokenizer.json" in names)
    if backend == "engine":
        _check_architecture(config, where)
        _check_weights(path, where, required=True)
    else:
        _check_weights(path, where, required=False)  # TensorRT-LLM reads *.engine or the checkpoint itself


def check_gguf(path: Path, backend: str) -> None:
    """A GGUF file the embedded engine can serve: readable, a version, architecture, tensor types and tokenizer we
    take (core/gguf_file.py says which)."""
    if backend != "engine":
        raise StartupError(f"--model {path}: a GGUF file is served by the embedded engine (--backend engine); "
                           f"--backend {backend} takes a checkpoint directory")
    from .executors import check_engine_gguf

    try:
        check_engine_gguf(str(path))
    except GGUFError as exc:
        raise StartupError(f"--model {exc}") from None
    except ValueError as exc:
        raise StartupError(f"--model {path}: {exc}") from None


def _read_json(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise StartupError(f"{where}: cannot read {path.name} ({exc.strerror})") from None
    except ValueError as exc:
        raise StartupError(f"{where}: {path.name} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise StartupError(f"{where}: {path.name} is not a JSON object")
    return data


def _check_tokenizer(path: Path, where: str, present: bool) -> None:
    if not present:
        raise StartupError(f"{where}: no tokenizer.json; tokenloop tokenizes with the checkpoint's tokenizer.json "
                           "(a Hugging Face fast tokenizer)")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001  (tokenizers raises plain Exception subclasses)
        raise StartupError(f"{where}: tokenizer.json cannot be loaded ({exc})") from None


def _check_architecture(config: dict, where: str) -> None:
    from .executors import check_engine_architecture

    try:
        check_engine_architecture(config)
    except (KeyError, TypeError) as exc:
        raise StartupError(f"{where}: config.json lacks a field the engine needs ({exc})") from None
    except ValueError as exc:
        raise StartupError(f"{where}: {exc} (--backend engine)") from None


def _weight_files(path: Path, where: str) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, where).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise StartupError(f"{where}: model.safetensors.index.json names missing weight files: "
                               f"{', '.join(missing[:3])}")
        return files
    return sorted(path.glob("*.safetensors"))


def _check_weights(path: Path, where: str, required: bool) -> None:
    """Every safetensors file's header can be read (the tensors themselves load later)."""
    from safetensors import safe_open

    files = _weight_files(path, where)
    if required and not files:
        raise StartupError(f"{where}: no *.safetensors weights (the embedded engine reads safetensors)")
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001  (SafetensorError, OSError, ...)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(f"{where}: cannot read the weights in {file.name} ({reason})") from None


# -- TLS and API keys ----------------------------------------------------------------------
def _readable(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"{flag} {path}: {exc.strerror}") from None


def check_tls(cert: str, key: str, client_ca: str) -> None:
    """The certificate chain and key are PEM and belong together; the client CA bundle is PEM."""
    if not cert:
        return
    if b"-----BEGIN CERTIFICATE-----" not in _readable(cert, "--tls-cert"):
        raise StartupError(f"--tls-cert {cert}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if b"PRIVATE KEY-----" not in _readable(key, "--tls-key"):
        raise StartupError(f"--tls-key {key}: holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise StartupError(f"--tls-key {key}: does not match the certificate in --tls-cert {cert}") from None
        raise StartupError(f"--tls-cert {cert} / --tls-key {key}: cannot be loaded ({exc.reason or exc})") from None
    if client_ca:
        _readable(client_ca, "--tls-client-ca")
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise StartupError(f"--tls-client-ca {client_ca}: holds no PEM CA certificate ({exc.reason or exc})") \
                from None


def check_api_key_file(path: str, flag: str = "--api-key-file") -> None:
    """The file is readable and holds at least one key (never serve openly by mistake)."""
    if not path:
        return
    text = _readable(path, flag).decode(errors="replace")
    if not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
        what = "admin key" if flag == "--admin-key-file" else "API key"
        raise StartupError(f"{flag} {path}: holds no {what} (one per line; # starts a comment)")


def check_lora_roots(roots: tuple[str, ...]) -> None:
    """Each `--lora-root DIR` is a directory."""
    for root in roots:
        if not Path(root).is_dir():
            raise StartupError(f"--lora-root {root}: no such directory")


# -- ports ---------------------------------------------------------------------------------
def check_listen(host: str, port: int, flag: str) -> None:
    """`host:port` can be bound now (as grpc binds it: SO_REUSEADDR, so a socket in TIME_WAIT does not count)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: cannot be resolved ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise StartupError(_bind_message(host, port, flag, exc)) from None


def _bind_message(host: str, port: int, flag: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{flag} {port}: {host}:{port} is already in use by another process; choose another {flag}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"{flag} {port}: permission denied (ports below 1024 need privileges)"
    return f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})"
