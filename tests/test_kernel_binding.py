"""kernel.c is the one source of the decode kernel's signatures and struct (rloo.engine.binding): the binding is
read from it, calls go by the C parameter names, a library built from another source or a struct the binding
reads differently is refused at load, and without a compiler (or with a build that fails) the decode step runs on
torch and says so."""

import ctypes
import logging

import pytest

from helpers import config, small_llama
from rloo.engine import binding, kernel


def _library():
    library = kernel.compiled()
    if library is None:
        pytest.skip("no decode kernel on this machine (not x86-64 Linux with gcc)")
    return library


def test_the_binding_is_read_from_the_c_source():
    signatures = binding.functions(kernel.SOURCE)
    assert {"pack", "linear", "attend", "draw", "decode_step", "source_id", "layer_size"} <= set(
        signatures
    )
    step = signatures["decode_step"]
    assert step.names[:3] == ("layers", "count", "final_norm") and step.names[-2:] == (
        "tokens",
        "row_of",
    )
    assert len(step.names) == 30 and step.result is None
    assert signatures["draw"].types[-2:] == (
        ctypes.c_void_p,
        ctypes.c_int,
    )  # long *tokens, int threads
    assert not any(
        name in signatures for name in ("gemm", "attention", "rms_norm")
    )  # static: internal
    fields = [name for name, _ in binding.layer_struct(kernel.SOURCE)._fields_]
    assert fields[:2] == ["norm1", "qkv"] and fields[-2:] == ["shared_keys", "shared_values"]
    assert ctypes.sizeof(_library().Layer) == _library().layer_size()


def test_calls_go_by_the_c_parameter_names():
    library = _library()
    with pytest.raises(
        TypeError, match=r"kernel linear: missing \['threads'\], unknown \['thread'\]"
    ):
        library.linear(x=0, p=0, bias=0, y=0, m=0, n=0, k=0, thread=1)
    with pytest.raises(TypeError, match="pass arguments by their C names"):
        library.linear(0, 0, 0, 0, 0, 0, 0, 1)
    with pytest.raises(AttributeError, match="exports no function 'gemm'"):
        library.gemm


def test_a_library_from_another_source_or_struct_is_refused_at_load(monkeypatch):
    path = _library()._cdll._name
    with pytest.raises(RuntimeError, match="built from another kernel.c.*Fix: delete it"):
        binding.Library(path, kernel.SOURCE + "\n/* an edit */\n")
    # A struct the binding reads with one field more than the library was built with (same source id):
    edited = kernel.SOURCE.replace("float *keys, *values;", "float *keys, *values, *extra;")
    built_from = binding.source_id(kernel.SOURCE)
    monkeypatch.setattr(binding, "source_id", lambda source: built_from)
    with pytest.raises(RuntimeError, match="the C `layer` struct is .* bytes, its binding"):
        binding.Library(path, edited)


@pytest.mark.parametrize("failure", ["no compiler", "build fails"])
def test_without_the_kernel_the_decode_step_runs_on_torch_and_says_so(
    tmp_path, monkeypatch, caplog, tokenizer, failure
):
    from rloo.generation import LeanGenerator, TransformersGenerator

    monkeypatch.setenv("RLOO_CACHE", str(tmp_path))  # (a fresh build, not the cached library)
    if failure == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    else:
        compiler = tmp_path / "failing-gcc"
        compiler.write_text("#!/bin/sh\necho 'gcc: internal error' >&2\nexit 1\n")
        compiler.chmod(0o755)
        monkeypatch.setenv("CC", str(compiler))
    kernel.compiled.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rloo.engine.kernel"):
            assert kernel.for_decoding() is None
            model = small_llama(tokenizer)
            prompts = [tokenizer("the dog sat")["input_ids"], tokenizer("a big cat")["input_ids"]]
            generation = config(tokenizer, do_sample=False, max_new_tokens=6)
            ours = LeanGenerator(
                generation, tokenizer.pad_token_id, [tokenizer.eos_token_id]
            ).generate(model, prompts, 1, 0)
            theirs = TransformersGenerator(
                generation, tokenizer.pad_token_id, [tokenizer.eos_token_id]
            ).generate(model, prompts, 1, 0)
        assert ours == theirs
        lines = [
            r.getMessage()
            for r in caplog.records
            if "the decode step runs on torch" in r.getMessage()
        ]
        assert len(lines) == 1, lines
    finally:
        kernel.compiled.cache_clear()
