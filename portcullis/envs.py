"""Every environment variable Portcullis reads, in one place (as vLLM's `envs.py`): its name,
what it does, and how it is read. Code reads them through here, never `os.environ` by a name
of its own, so each is documented where it is declared (`portcullis envs` lists them).
Standard library only: the gateway, the engine and the kernels all import it.

Besides these, only other programs' conventions are read, each as its owner defines it
(`CONVENTIONS`: the XDG base directories for caches and sockets, `CXX` for the C++ compiler that
builds the native kernels, OpenMP's `GOMP_SPINCOUNT` and `OMP_WAIT_POLICY`, and Gloo's and NCCL's
`GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME`, set by the engine when unset), and the variable a policy names for its JWT secret (`jwt.hs256_secret_env`).
tests/test_house.py checks that every read in the package is one of these."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """Its value, stripped; "" when unset."""
        return (os.environ if environ is None else environ).get(self.name, "").strip()

    def flag(self, default: bool, environ: Mapping[str, str] | None = None) -> bool:
        """On or off (1/true/yes/on, 0/false/no/off); `default` when unset or otherwise."""
        value = self.get(environ).lower()
        return True if value in TRUE else False if value in FALSE else default


CACHE_DIR = Variable("PORTCULLIS_CACHE_DIR", "Where `make setup`'s real models and the built native kernels are "
                     "kept (default: $XDG_CACHE_HOME/portcullis, else ~/.cache/portcullis).")
HOME = Variable("PORTCULLIS_HOME", "`portcullis serve`'s folder for its policy, keys and audit log (default ~/.portcullis).")
ENGINE_TOKEN = Variable("PORTCULLIS_ENGINE_TOKEN", "The engine's internal token when no token file is given; "
                        "`serve` passes it to its children and to no other process.")
GATEWAY_SETTINGS = Variable("PORTCULLIS_GATEWAY_SETTINGS", "Set by `portcullis gateway` for its worker processes "
                            "(the settings as JSON, without the token); not for users.")
AUDIT_KEYRING = Variable("PORTCULLIS_AUDIT_KEYRING", "The audit log's keyring file, for `portcullis audit verify` "
                         "when --keyring is not given.")
CPU_DTYPE = Variable("PORTCULLIS_CPU_DTYPE", "float32, bfloat16 or auto: the dtype `--dtype auto` takes on a CPU "
                     "(auto: bf16 only where a probe shows it pays).")
GGUF_DEQUANTIZE = Variable("PORTCULLIS_GGUF_DEQUANTIZE", "1: dequantize a GGUF's weights at load (the reference "
                           "path) instead of running them as stored on the CPU.")
GGUF_ACTIVATIONS = Variable("PORTCULLIS_GGUF_ACTIVATIONS", "int8: round activations to int8 per block of 32 for "
                            "the CPU kernel's integer products (llama.cpp's arithmetic); default float32.")
CPU_ISA = Variable("PORTCULLIS_CPU_ISA", "The instruction set the native kernels are built for (a -march value, "
                   "e.g. x86-64-v3); default: this CPU's.")
NATIVE_KERNELS = Variable("PORTCULLIS_NATIVE_KERNELS", "0: never build or load the native C++ kernels (PyTorch's "
                          "operators instead).")
ATTENTION = Variable("PORTCULLIS_ATTENTION", "triton or torch: the attention kernels (default: Triton on CUDA "
                     "tensors, PyTorch elsewhere).")
DISTRIBUTED_TIMEOUT = Variable("PORTCULLIS_DISTRIBUTED_TIMEOUT_S", "Seconds an engine process waits on another "
                               "(a step's hand-off, a collective) before the engine ends with an error (default 600); "
                               "idle ranks are kept alive by heartbeats at a third of it.")
VLLM_API_KEY = Variable("VLLM_API_KEY", "The default of `portcullis serve --api-key`, as vLLM reads it: one "
                       "static key for clients, stored hashed.")
OPENAI_API_KEY = Variable("OPENAI_API_KEY", "The default of `portcullis bench serve --api-key`, as OpenAI's "
                          "clients read it: the bearer token sent to the server measured.")
PROMETHEUS_MULTIPROC_DIR = Variable("PROMETHEUS_MULTIPROC_DIR", "Set by `portcullis gateway --workers N` for its "
                                    "workers (prometheus_client's: their metric files); not for users.")
STUB_ENGINE_TOKEN = Variable("STUB_ENGINE_TOKEN", "The test stub engine's internal token when it is given no "
                             "--token-file (`python -m portcullis.testing.stub_engine`); tests only.")
VARIABLES = (CACHE_DIR, HOME, ENGINE_TOKEN, GATEWAY_SETTINGS, AUDIT_KEYRING, CPU_DTYPE, GGUF_DEQUANTIZE,
             GGUF_ACTIVATIONS, CPU_ISA,
             NATIVE_KERNELS, ATTENTION, DISTRIBUTED_TIMEOUT, VLLM_API_KEY, OPENAI_API_KEY, PROMETHEUS_MULTIPROC_DIR,
             STUB_ENGINE_TOKEN)
# Other programs' variables, read (or, for OpenMP, set when unset) as their owners define them.
CONVENTIONS = ("XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "CXX", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
               "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def cache_root() -> Path:
    """Portcullis's cache folder (`PORTCULLIS_CACHE_DIR`, else the XDG cache's `portcullis`)."""
    override = CACHE_DIR.get()
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "portcullis"
