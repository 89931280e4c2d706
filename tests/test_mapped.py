"""rloo.engine.mapped: the reference model's weights in a shared file mapping whose pages leave the process after each
module's forward and after each reference forward, with the same values, ties and outputs as a plain copy; never on a memory filesystem."""

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import conversational, make_args, position_reward
from rloo import RLOOTrainer
from rloo.engine import mapped
from rloo.models import create_reference_model
from rloo.tiny import tiny_config

needs_a_disk = pytest.mark.skipif(
    mapped.disk_directory(64 << 20) is None,
    reason="no writable disk filesystem for the temporary file (only tmpfs or none)",
)


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes (smaps `Rss`) of the mapping that holds `tensor`."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                begin, end = (int(part, 16) for part in head.split("-"))
                inside = begin <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        tiny_config(20000, tie_word_embeddings=True)
    ).eval()  # a 2.5 MiB tied embedding


@needs_a_disk
def test_a_mapped_copy_is_the_model_and_its_pages_leave_the_process_after_each_use():
    model = _model()
    reference = create_reference_model(model)
    flat = reference._rloo_mapping
    size = flat.numel()
    assert _resident_bytes(flat) == 0  # written, then paged out
    assert size >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert reference.lm_head.weight is reference.model.embed_tokens.weight  # still tied
    for (name, ours), theirs in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name
        assert flat.data_ptr() <= ours.data_ptr() < flat.data_ptr() + size, name  # in the mapping
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    mapped.page_out(reference)
    ids = torch.randint(3, 20000, (2, 7))
    with mapped.paged_out_after(reference):
        torch.nn.functional.embedding(
            ids, reference.lm_head.weight
        )  # (a read outside any module: stays mapped)
        assert _resident_bytes(flat) > 0
        logits = reference(ids).logits
        assert (
            _resident_bytes(flat) < 0.05 * size
        )  # each module's weights left when its forward was done
    assert _resident_bytes(flat) == 0
    assert torch.equal(logits, model(ids).logits)
    assert torch.equal(
        reference(ids).logits, logits
    )  # read again from the page cache: the same values


@needs_a_disk
def test_what_is_written_into_a_mapped_copy_survives_paging_out():
    """The sync_ref_model mix and a resumed checkpoint write into the reference in place: a shared mapping keeps it
    (a private one would drop the written pages on MADV_DONTNEED)."""
    model = _model()
    reference = create_reference_model(model)
    changed = {name: value + 1 for name, value in model.state_dict().items()}
    reference.load_state_dict(changed)
    mapped.page_out(reference)
    for name, value in reference.state_dict().items():
        assert torch.equal(value, changed[name]), name


def test_no_mapping_on_a_memory_filesystem(monkeypatch, tmp_path):
    """tmpfs pages cannot be reclaimed: there the reference stays a plain copy in the process."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "23 22 0:21 / /dev/shm rw shared:2 - tmpfs tmpfs rw\n"
        "24 22 0:22 / /data\\040sets rw shared:3 - xfs /dev/vdb rw\n"
        "25 22 0:23 / /scratch rw shared:4 - ext4 /dev/vdc rw\n"
        "26 22 0:24 / /scratch rw shared:5 - tmpfs tmpfs rw\n"
    )
    kinds = {
        path: mapped.filesystem_type(path, str(mountinfo))
        for path in ("/dev/shm/x", "/data sets/y", "/data", "/scratch", "/dev/shmx", "/home")
    }
    assert kinds == {
        "/dev/shm/x": "tmpfs",
        "/data sets/y": "xfs",
        "/data": "ext4",
        "/scratch": "tmpfs",
        "/dev/shmx": "ext4",
        "/home": "ext4",
    }
    if mapped.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    monkeypatch.setattr(mapped, "candidate_directories", lambda: ["/dev/shm"])
    model = _model()
    assert mapped.mapped_copy(model) is None
    reference = create_reference_model(model)
    assert not hasattr(reference, "_rloo_mapping") and torch.equal(
        reference.lm_head.weight, model.lm_head.weight
    )


@needs_a_disk
def test_the_trainers_reference_is_mapped_and_paged_out_after_its_forward(
    tmp_path, tokenizer, model
):
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=[position_reward],
        args=make_args(tmp_path, beta=0.1, max_steps=1),
        train_dataset=conversational(),
        processing_class=tokenizer,
    )
    flat = trainer.ref_model._rloo_mapping
    trainer.train()
    assert trainer.state.log_history[0]["kl"] >= 0
    assert _resident_bytes(flat) == 0
