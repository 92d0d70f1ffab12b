"""`--model openclip:ARCH` through the command line: a tiny open_clip model saved as a file,
its zero-shot head from `--classes` and `--templates`, `cafa stats`, `adapt`, `bench` and
`inspect` on it, the classic methods on its image encoder, and the errors."""

import json
import sys

import pytest
import torch
from conftest import invoke, write_folder
from helpers import fails, rows, tiny_clip

from cafa_cli.artifact.store import read_artifact
from cafa_cli.jobs.shared.inputs import default_preprocessing
from cafa_cli.model.clip import Prompting, class_embeddings, prompt_name
from cafa_cli.model.loading import load_model

pytest.importorskip("open_clip")

CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """tiny_clip saved as a state dict, its config file, a class list, train and test folders, an artifact."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("clip")
    model, _ = tiny_clip()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "tiny.safetensors")
    (root / "tiny.json").write_text(json.dumps(CONFIG))
    (root / "classes.txt").write_text("".join(f"{n}\n" for n in NAMES))
    setup = {
        "model": f"openclip:{root / 'tiny.json'}",
        "weights": root / "tiny.safetensors",
        "classes": root / "classes.txt",
        "train": write_folder(root / "train", per_class=6),
        "test": write_folder(root / "test", per_class=4, seed=1, shift=0.3),
        "root": root,
    }
    result = invoke(
        "stats", *_model(setup), "--data", setup["train"], "--fraction", "1", "--out", root / "s.safetensors"
    )
    assert result.exit_code == 0, result.stderr
    setup["artifact"] = root / "s.safetensors"
    return setup


def _model(setup, classes=True):
    """The options naming the tiny CLIP."""
    return ["--model", setup["model"], "--weights", setup["weights"], *(["--classes", setup["classes"]] * classes)]


def _adapt(setup, *args):
    return invoke("adapt", "--stats", setup["artifact"], "--data", setup["test"], "--batch-size", "4", *args)


def test_the_zero_shot_head_of_the_loaded_file_is_open_clips_own(clip):
    """The weights go in (the logits are those of the model that was saved) and the head is the classes'."""
    model, tokenizer = tiny_clip()
    net = load_model(clip["model"], clip["weights"], class_names=list(NAMES))
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        image, text, scale = model(images, tokenizer([f"a photo of a {n}." for n in NAMES]))
        logits, features = net(images)
    torch.testing.assert_close(logits, scale * image @ text.T, rtol=1e-5, atol=1e-5)
    assert net.num_classes == 3 and not any(p is net.classifier.weight for p in net.parameters())


def test_stats_records_the_model_and_its_prompts_and_adapt_runs_cafa_from_the_artifact(clip):
    artifact = read_artifact(clip["artifact"])
    assert artifact.model.model == clip["model"] and artifact.model.weights == str(clip["weights"])
    assert artifact.model.templates == "single" and len(artifact.model.prompts_sha256) == 64
    assert artifact.model_class_names == list(NAMES) and artifact.feature_dim == 16
    assert artifact.preprocessing.resize == artifact.preprocessing.crop == 16  # the config's image size
    assert artifact.preprocessing.interpolation == "bicubic"
    result = _adapt(clip, "--method", "cafa")
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 12 and {r["prediction"] for r in rows(result)} <= set(NAMES)
    assert "LayerNorm" in result.stderr
    shown = invoke("inspect", clip["artifact"])
    assert shown.exit_code == 0 and "openclip:" in shown.stdout


@pytest.mark.parametrize("method", ["tent", "t3a", "shot"])
def test_classic_methods_run_on_the_clip_image_encoder(clip, method):
    result = _adapt(clip, "--method", method)
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 12


def test_a_method_that_needs_batchnorms_declines_in_one_line(clip):
    fails(_adapt(clip, "--method", "cafa-robust"), 3, "no BatchNorm layers", "--method cafa")


def test_bench_runs_on_a_clip_model(clip, tmp_path):
    result = invoke(
        "bench",
        clip["test"],
        *_model(clip),
        "--train",
        clip["train"],
        "--methods",
        "source,cafa",
        "--fraction",
        "1",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
    )
    assert result.exit_code == 0, result.stderr
    assert "cafa" in result.stdout


def test_a_clip_model_without_class_names_is_refused(clip, tmp_path):
    fails(
        invoke("stats", *_model(clip, classes=False), "--data", clip["train"], "--out", tmp_path / "s.safetensors"),
        2,
        "is a CLIP model",
        "--classes FILE",
    )
    assert not (tmp_path / "s.safetensors").exists()


def test_on_an_imagenet_benchmark_a_clip_model_prompts_imagenets_classes(clip, tmp_path):
    from PIL import Image

    from cafa_cli.data.benchmarks import imagenet_classes

    wnids = list(imagenet_classes())
    for wnid in (wnids[1], wnids[2]):
        (tmp_path / wnid).mkdir()
        Image.new("RGB", (16, 16), 7).save(tmp_path / wnid / "a.JPEG")
    data = f"imagenet-sketch:{tmp_path}"
    result = invoke("adapt", *_model(clip, classes=False), "--method", "source", "--data", data)
    assert result.exit_code == 0, result.stderr
    assert {row["label"] for row in rows(result)} == {wnids[1], wnids[2]}
    assert {row["prediction"] for row in rows(result)} <= set(wnids)


def test_an_artifact_of_other_prompts_is_refused(clip):
    fails(_adapt(clip, "--method", "cafa", "--templates", "imagenet80"), 3, "prompts", "imagenet80")


def test_templates_single_imagenet80_a_file_and_cupl_descriptions(clip, tmp_path):
    model, tokenizer = tiny_clip()
    texts = Prompting(("n01440764",), "imagenet80").texts(model, tokenizer)
    assert len(texts.class_prompts(0)) == 80 and texts.class_prompts(0)[0] == "a bad photo of a tench."
    assert prompt_name("n01443537") == "goldfish" and prompt_name("cat") == "cat"
    lines = tmp_path / "templates.txt"
    lines.write_text("a {} here.\nitap of a {}.\n")
    assert Prompting(("cat",), str(lines)).texts(model, tokenizer).class_prompts(0) == ("a cat here.", "itap of a cat.")
    cupl = tmp_path / "cupl.json"
    cupl.write_text(json.dumps({"tench": ["a fish.", "a green fish."], "dog": ["a pet."]}))
    described = Prompting(("n01440764", "dog"), str(cupl)).texts(model, tokenizer)
    assert described.class_prompts(0) == ("a fish.", "a green fish.") and described.class_prompts(1) == ("a pet.",)
    assert class_embeddings(described).shape == (2, 16)


def test_class_names_as_a_json_list(clip, tmp_path):
    names = tmp_path / "classes.json"
    names.write_text(json.dumps(list(NAMES)))
    result = invoke(
        "adapt", *_model(clip, classes=False), "--classes", names, "--method", "t3a", "--data", clip["test"]
    )
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 12


@pytest.mark.parametrize(
    ("templates", "write", "code", "needles"),
    [
        ("imagenet8O", None, 2, ("no such file, nor a template set", "did you mean imagenet80")),
        ("t.txt", "a photo.\n", 3, ("where the class name goes once in each",)),
        ("t.json", '{"z": ["a z."]}', 3, ("no descriptions of a, b, c",)),
    ],
)
def test_bad_templates(clip, tmp_path, templates, write, code, needles):
    if write is not None:
        (tmp_path / templates).write_text(write)
        templates = str(tmp_path / templates)
    fails(
        invoke("adapt", *_model(clip), "--method", "tent", "--templates", templates, "--data", clip["test"]),
        code,
        *needles,
    )


def test_templates_for_a_model_that_is_no_clip_are_refused(tmp_path):
    from conftest import TINY_NET

    result = invoke("adapt", "--model", TINY_NET, "--method", "tent", "--templates", "imagenet80", "--data", tmp_path)
    fails(result, 2, "--templates words a CLIP model's classes")


def test_an_unknown_architecture_gets_a_did_you_mean(clip):
    fails(
        invoke("adapt", "--model", "openclip:vit-b-32", "--method", "tent", "--data", clip["test"]),
        2,
        "(did you mean ViT-B-32?)",
    )


def test_without_open_clip_the_error_names_the_extra_to_install(clip, monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)
    fails(
        invoke("adapt", *_model(clip), "--method", "tent", "--data", clip["test"]),
        2,
        "needs open_clip, which is not installed: pip install 'cafa-cli[clip]'",
    )


def test_pretrained_tags_come_from_the_local_cache_only(clip, tmp_path, monkeypatch):
    """A tag's file missing from the Hugging Face cache: one line with the command that fetches it
    elsewhere; nothing is downloaded. A tag open_clip does not know, and one trained with QuickGELU
    on an architecture without it, are usage errors."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path))  # open_clip's own cache of URL files, ~/.cache/clip
    common = ("--classes", clip["classes"], "--method", "tent", "--data", clip["test"])
    fails(
        invoke("adapt", "--model", "openclip:ViT-B-32", "--weights", "laion2b_s34b_b79k", *common),
        3,
        "is not in the Hugging Face hub cache",
        "cafa downloads nothing",
        "open_clip.create_model('ViT-B-32', pretrained='laion2b_s34b_b79k')",
    )
    fails(
        invoke("adapt", "--model", "openclip:ViT-B-32", "--weights", "laion2b_s34b_b79", *common),
        2,
        "nor a pretrained tag of open_clip's ViT-B-32 (did you mean laion2b_s34b_b79k?)",
    )
    fails(
        invoke("adapt", "--model", "openclip:ViT-B-32", "--weights", "openai", *common),
        2,
        "trained with QuickGELU",
        "openclip:ViT-B-32-quickgelu",
    )


def test_preprocessing_comes_from_the_models_config(clip, tmp_path):
    tagged = default_preprocessing("openclip:ViT-B-32", "laion2b_s34b_b79k")
    assert (tagged.resize, tagged.crop, tagged.interpolation) == (224, 224, "bicubic")
    assert tagged.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    declared = tmp_path / "declared.json"
    declared.write_text(json.dumps({"model_cfg": CONFIG, "preprocess_cfg": {"mean": [0.5] * 3, "std": [0.25] * 3}}))
    own = default_preprocessing(f"openclip:{declared}")
    assert (own.resize, own.mean, own.std) == (16, (0.5,) * 3, (0.25,) * 3)
