"""``rde evaluate --model KIND:TARGET``: the spec syntax, each form's loader on tiny models built from
config (no hub), the checks a retriever's vectors pass, lineage, and scores files read back exactly."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_clip, build_tiny_dinov2, random_images

from models.backends.interfaces import l2_normalize
from models.backends.registry import ModelRegistry, models_lineage
from models.specs import ModelSpec, ModelsSection
from rde.evaluation.retriever_specs import fingerprint
from rde.evaluation.retrievers import (
    FORMS,
    KINDS,
    RetrieverError,
    RetrieverSpec,
    load_retriever,
    parse_retriever,
    retriever_lineage,
)
from rde.evaluation.scores_file import (
    ScoresFileError,
    ranked_rows,
    read_scores,
    write_scores_parquet,
    write_trec_run,
)
from rde.profile import load_profile

TEXTS = ["a person in a red jacket", "a white van", "a man with a backpack"]

# The documentation's example of a python: retriever (docs: rde evaluate --model python:my_retriever.py:make).
EXAMPLE = '''\
"""A retriever for `rde evaluate --model python:my_retriever.py:make`: colour words vs mean colour."""
import numpy as np


class ColourRetriever:
    def encode_text(self, texts):  # one row per text
        return np.array([[t.count("red"), t.count("green"), t.count("blue")] for t in texts], float)

    def encode_image(self, images):  # RGB uint8 arrays, one row per image
        return np.stack([image.reshape(-1, 3).mean(axis=0) for image in images])


def make():
    return ColourRetriever()
'''

FAULTY = '''\
import numpy as np


class Faulty:
    def __init__(self, fault):
        self.fault = fault

    def encode_text(self, texts):
        return np.ones((len(texts), 3))

    def encode_image(self, images):
        n, out = len(images), np.ones((len(images), 3))
        if self.fault == "rows" and n > 1:
            return out[1:]
        if self.fault == "width":
            return np.ones((n, 4))
        if self.fault == "nan" and n > 1:
            out[2, 1] = np.nan
        if self.fault == "flat":
            return out.ravel()
        if self.fault == "ints":
            return out.astype(int)
        return out


def rows(): return Faulty("rows")
def width(): return Faulty("width")
def nan(): return Faulty("nan")
def flat(): return Faulty("flat")
def ints(): return Faulty("ints")
def broken(): raise RuntimeError("no weights here")
not_callable = 3
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CLIP (transformers folder), the same CLIP as a sentence-transformers folder, a tiny DINOv2."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel

    root = tmp_path_factory.mktemp("tiny-retrievers")
    build_tiny_clip(root / "clip")
    # the module clip-ViT-B-32 is saved with (sentence_transformers.models.CLIPModel, its 6.x home)
    SentenceTransformer(modules=[CLIPModel(str(root / "clip"))], device="cpu").save(str(root / "st"))
    build_tiny_dinov2(root / "dinov2")
    return root


@pytest.fixture(scope="module")
def demo():
    return load_profile("demo")


def _load(text: str, profile) -> object:
    return load_retriever(parse_retriever(text), profile, device="cpu")


# --- the syntax -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind", "target"), [
    ("transformers-clip:/models/clip", "transformers-clip", "/models/clip"),
    ("transformers-clip:openai/clip-vit-base-patch32", "transformers-clip", "openai/clip-vit-base-patch32"),
    ("sentence-transformers:clip-ViT-B-32", "sentence-transformers", "clip-ViT-B-32"),
    ("open-clip:ViT-B-32:laion2b_s34b_b79k", "open-clip", "ViT-B-32:laion2b_s34b_b79k"),
    ("open-clip:hf-hub:timm/ViT-B-16-SigLIP", "open-clip", "hf-hub:timm/ViT-B-16-SigLIP"),
    ("expert:attributes", "expert", "attributes"),
    ("student:.rde/artifacts/train-saft/demo", "student", ".rde/artifacts/train-saft/demo"),
    ("python:my_retriever:make", "python", "my_retriever:make"),
    ("python:./code/my_retriever.py:make", "python", "./code/my_retriever.py:make"),
    ("scores:runs/bm25.trec", "scores", "runs/bm25.trec"),
    ("  scores:runs/bm25.parquet ", "scores", "runs/bm25.parquet"),
])
def test_each_form_parses(text: str, kind: str, target: str) -> None:
    spec = parse_retriever(text)
    assert (spec.text, spec.kind, spec.target) == (text.strip(), kind, target)
    assert spec.kind in KINDS
    import re

    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*-[0-9a-f]{8}", spec.slug), spec.slug
    assert len(spec.slug) <= 60


def test_slugs_are_unique_per_text_and_readable() -> None:
    a, b = parse_retriever("transformers-clip:/models/a/clip"), parse_retriever("transformers-clip:/models/b/clip")
    assert a.slug != b.slug and a.slug.startswith("transformers-clip-clip-")
    assert parse_retriever("scores:x/Run File.trec").slug.startswith("scores-run-file-")
    assert a.slug == parse_retriever("transformers-clip:/models/a/clip").slug


@pytest.mark.parametrize("text", ["clip:/models/clip", "openai/clip-vit-base-patch32", "", "EXPERT:attributes"])
def test_an_unknown_form_lists_every_form_in_one_line(text: str) -> None:
    with pytest.raises(RetrieverError) as err:
        parse_retriever(text)
    message = str(err.value)
    assert "\n" not in message and all(form in message for form in FORMS)


@pytest.mark.parametrize(("text", "says"), [
    ("expert:", "nothing after"), ("open-clip:ViT-B-32", "architecture and its weights"),
    ("open-clip:ViT-B-32:", "architecture and its weights"), ("python:my_retriever", "a module and a factory"),
    ("python:my_retriever:make()", "a module and a factory"),
])
def test_a_malformed_target_says_what_the_form_needs(text: str, says: str) -> None:
    with pytest.raises(RetrieverError, match=says):
        parse_retriever(text)


# --- loaders on tiny models -------------------------------------------------------------------------


def test_transformers_clip_folder_loads_through_the_registry(tiny: Path, demo) -> None:
    from models.backends.experts import TransformersClipExpert

    model = _load(f"transformers-clip:{tiny / 'clip'}", demo)
    direct = TransformersClipExpert(ModelSpec(backend="transformers-clip", model_id=str(tiny / "clip")))
    images = random_images(3)
    assert model.dim == 16 and model.model_id == f"transformers-clip:{tiny / 'clip'}"
    np.testing.assert_allclose(model.encode_text(TEXTS), direct.encode_text(TEXTS), atol=1e-6)
    np.testing.assert_allclose(model.encode_image(images), direct.encode_image(images), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(model.encode_image(images), axis=1), 1.0, atol=1e-5)
    assert model.encode_text([]).shape == (0, 16)


def test_sentence_transformers_clip_gives_the_same_space_as_transformers(tiny: Path, demo) -> None:
    """The sentence-transformers folder wraps the same CLIP weights: the same vectors."""
    st = _load(f"sentence-transformers:{tiny / 'st'}", demo)
    hf = _load(f"transformers-clip:{tiny / 'clip'}", demo)
    images = random_images(4, seed=1)
    assert st.dim == 16
    np.testing.assert_allclose(st.encode_text(TEXTS), hf.encode_text(TEXTS), atol=1e-5)
    np.testing.assert_allclose(st.encode_image(images), hf.encode_image(images), atol=1e-5)
    assert st.encode_image(images).dtype == np.float32
    for backend in ("sentence-transformers", "open-clip"):  # a profile may name them as experts (and teacher)
        ModelsSection(experts=[ModelSpec(backend=backend, model_id="x")], teacher=ModelSpec(backend=backend,
                                                                                           model_id="x"))


def test_a_text_only_sentence_transformer_is_refused(tmp_path: Path, tiny: Path, demo) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from tiny_models import build_tiny_bert

    SentenceTransformer(modules=[Transformer(str(build_tiny_bert(tmp_path / "bert")))], device="cpu").save(
        str(tmp_path / "text-only"))
    with pytest.raises(RetrieverError, match="not images"):
        _load(f"sentence-transformers:{tmp_path / 'text-only'}", demo)


OPEN_CLIP_TINY = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
                  "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def test_open_clip_architecture_file_and_checkpoint(tmp_path: Path, demo) -> None:
    import open_clip
    from PIL import Image

    config = tmp_path / "tiny-openclip-test.json"
    config.write_text(json.dumps(OPEN_CLIP_TINY))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    reference, _, preprocess = open_clip.create_model_and_transforms(config.stem, pretrained=None)
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    reference.eval()
    model = _load(f"open-clip:{config}:{tmp_path / 'weights.pt'}", demo)
    images = random_images(3, seed=2)
    with torch.no_grad():
        want_text = reference.encode_text(open_clip.get_tokenizer(config.stem)(TEXTS)).numpy()
        want_image = reference.encode_image(torch.stack([preprocess(Image.fromarray(i)) for i in images])).numpy()
    assert model.dim == 16
    np.testing.assert_allclose(model.encode_text(TEXTS), l2_normalize(want_text), atol=1e-5)
    np.testing.assert_allclose(model.encode_image(images), l2_normalize(want_image), atol=1e-5)


def test_open_clip_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, demo) -> None:
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip → ImportError
    with pytest.raises(RetrieverError) as err:
        _load("open-clip:ViT-B-32:laion2b_s34b_b79k", demo)
    assert str(err.value) == "open-clip: open_clip_torch is not installed; pip install '.[open-clip]'"


def test_a_missing_model_names_it_with_a_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries against the hub
    with pytest.raises(RetrieverError, match=f"no such file or folder: {tmp_path / 'absent'}"):
        _load(f"transformers-clip:{tmp_path / 'absent'}", demo)
    with pytest.raises(RetrieverError) as err:
        _load("transformers-clip:nobody/no-such-clip", demo)
    assert "transformers-clip:nobody/no-such-clip" in str(err.value) and "rde models fetch" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(RetrieverError, match="not a model to load"):
        _load(f"scores:{tmp_path / 'run.trec'}", demo)


def test_expert_by_backend_or_model_id(demo) -> None:
    model = _load("expert:attributes", demo)
    registry_expert = ModelRegistry.of(demo).expert(demo.models.experts[1])
    images = random_images(2, seed=3)
    assert model.dim == registry_expert.dim and model.track_slots  # the wrapped expert's attributes pass through
    np.testing.assert_allclose(model.encode_text(TEXTS), l2_normalize(registry_expert.encode_text(TEXTS)))
    np.testing.assert_allclose(model.encode_image(images), l2_normalize(registry_expert.encode_image(images)))
    assert _load("expert:attributes-v1", demo).inner is registry_expert
    lineage = retriever_lineage(parse_retriever("expert:attributes"), demo)
    assert lineage["expert"] == ModelRegistry.of(demo).lineage(demo.models.experts[1])
    with pytest.raises(RetrieverError, match=r"no expert .* 'clip' \(its experts: semantic-bridge"):
        _load("expert:clip", demo)


# --- python: user code --------------------------------------------------------------------------------


def test_python_factory_from_a_file_and_a_dotted_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo) -> None:
    (tmp_path / "my_retriever_doc.py").write_text(EXAMPLE)
    by_file = _load(f"python:{tmp_path / 'my_retriever_doc.py'}:make", demo)
    image = np.zeros((8, 4, 3), np.uint8)
    image[..., 0] = 200
    assert by_file.dim == 3 and by_file.model_id == f"python:{tmp_path / 'my_retriever_doc.py'}:make"
    np.testing.assert_allclose(by_file.encode_text(["red red", "blue"]), [[1, 0, 0], [0, 0, 1]])
    np.testing.assert_allclose(by_file.encode_image([image]), [[1, 0, 0]])
    assert by_file.encode_text(["nothing"]).tolist() == [[0, 0, 0]]  # a zero row stays zero
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_retriever_doc", raising=False)
    by_name = _load("python:my_retriever_doc:make", demo)
    np.testing.assert_allclose(by_name.encode_image([image]), [[1, 0, 0]])
    assert retriever_lineage(parse_retriever("python:my_retriever_doc:make"), demo)["factory"] == "make"


@pytest.mark.parametrize(("factory", "when", "message"), [
    ("rows", "encode", "encode_image returned shape (3, 3) for 4 images"),
    ("nan", "encode", "encode_image returned NaN values in 1 row of 4 (first: row 2)"),
    ("width", "load", "encode_image returned width 4, encode_text width 3"),
    ("flat", "load", "encode_image returned shape (3,) for 1 image"),
    ("ints", "load", "encode_image returned dtype int64, not float"),
    ("broken", "load", "broken() failed (RuntimeError: no weights here)"),
    ("not_callable", "load", "'not_callable' is a int, not a factory"),
    ("absent", "load", "has no 'absent'"),
])
def test_python_vectors_are_checked(tmp_path: Path, demo, factory: str, when: str, message: str) -> None:
    (tmp_path / "faulty_retriever.py").write_text(FAULTY)
    text = f"python:{tmp_path / 'faulty_retriever.py'}:{factory}"
    with pytest.raises(RetrieverError) as err:
        model = load_retriever(parse_retriever(text), demo)
        assert when == "encode", "the check at load time let it through"
        model.encode_image(random_images(4))
    assert str(err.value) == f"{text}: {message}" or (message in str(err.value) and text in str(err.value))
    assert "\n" not in str(err.value)


# --- student: a trained model ----------------------------------------------------------------------------


def _write_train_manifest(run: Path, method: str, key: str, profile, models: ModelsSection,
                          training_model: ModelSpec | None) -> None:
    """The train stage's manifest as the runner writes it (``tasks/framework/runner.py``): the declared
    config (training, evaluation) and the features artifact's lineage entry upstream."""
    from storage.artifact import Manifest

    training = profile.training.model_copy(update={"model": training_model})
    manifest = Manifest(kind="training_log", stage_key=key, schema="", shards=[], total_rows=0, fingerprint="",
                        created_at="", code_version="",
                        config={"training": training.model_dump(mode="json"),
                                "evaluation": profile.evaluation.model_dump(mode="json")},
                        upstream=[{"path": str(run / "shared"), "kind": "training_features", "stage_key": "f" * 64,
                                   "fingerprint": "", "total_rows": 1, "code_version": "",
                                   "models": {"models": models_lineage(models)}, "prompt_versions": {},
                                   "upstream": []}])
    (run / f"train_{method}_log").mkdir(parents=True)
    (run / f"train_{method}_log" / "_manifest.json").write_text(manifest.to_json())


@pytest.fixture(scope="module")
def tiny_towers(tiny: Path) -> ModelsSection:
    """A CPU student's towers, tiny: the tiny CLIP as the bridge (16-d) and tiny DINOv2 (48-d)."""
    return ModelsSection(experts=[ModelSpec(backend="transformers-clip", model_id=str(tiny / "clip"))],
                         image_embedder=ModelSpec(backend="transformers", model_id=str(tiny / "dinov2")))


def _feature_model(seed: int):
    from models.retrieval.dual_encoder import FeatureDualEncoder

    torch.manual_seed(seed)
    model = FeatureDualEncoder(bridge_dim=16, cnn_dim=48, text_dim=16)
    with torch.no_grad():  # "trained": away from the identity start
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def test_student_feature_model_computes_training_features(tmp_path: Path, tiny_towers: ModelsSection, demo) -> None:
    """A CPU student read from a run folder: the newest checkpoint, its towers from the run's manifest
    (not the demo profile's semantic bridge), features as training computes them."""
    from rde.training.checkpoints import CheckpointStore
    from rde.training.retrieval_features import image_features

    run, key = tmp_path / "train-saft" / "demo", "ab" * 32
    store = CheckpointStore(str(run / "train_saft" / "checkpoints" / key[:16]), keep=5)
    older, newer = _feature_model(1), _feature_model(2)
    store.save({"model": older.state_dict(), "step": 3})
    first = next((run / "train_saft" / "checkpoints" / key[:16]).glob("step-*.pt"))
    os.utime(first, ns=(1, 1))
    store.save({"model": newer.state_dict(), "step": 6})
    _write_train_manifest(run, "saft", key, demo, tiny_towers, None)

    student = _load(f"student:{run}", demo)
    registry = ModelRegistry(tiny_towers)
    bridge, embedder = registry.expert(tiny_towers.experts[0]), registry.image_embedder()
    images = random_images(3, seed=4)
    feats = image_features(images, ["a", "b", "c"], bridge, embedder, None, views=1).stacked()[0]
    with torch.no_grad():
        want_image = newer.encode_image(torch.from_numpy(feats)).numpy()
        want_text = newer.encode_text(torch.from_numpy(bridge.encode_text(TEXTS))).numpy()
    assert student.dim == 16
    np.testing.assert_allclose(student.encode_image(images), want_image, atol=1e-5)
    np.testing.assert_allclose(student.encode_text(TEXTS), want_text, atol=1e-5)
    lineage = retriever_lineage(parse_retriever(f"student:{run}"), demo)
    assert lineage["config"].startswith("manifest ") and lineage["checkpoint"] == fingerprint(
        run / "train_saft" / "checkpoints" / key[:16] / "step-000000006.pt")  # the newest
    assert lineage["towers"]["bridge"]["model_id"] == str(tiny_towers.experts[0].model_id)

    # a checkpoint file copied out of its run: no manifest beside it, the profile given says the towers
    loose = tmp_path / "copied.pt"
    loose.write_bytes(first.read_bytes())
    profile = demo.model_copy(update={"models": tiny_towers})
    copied = _load(f"student:{loose}", profile)
    with torch.no_grad():
        np.testing.assert_allclose(copied.encode_image(images), older.encode_image(torch.from_numpy(feats)).numpy(),
                                   atol=1e-5)
    assert retriever_lineage(parse_retriever(f"student:{loose}"), profile)["config"] == "profile demo"


def test_student_clip_model_from_its_model_file(tmp_path: Path, tiny: Path, demo) -> None:
    from models.retrieval.dual_encoder import HFClipDualEncoder

    run = tmp_path / "train-gtr" / "demo"
    model = HFClipDualEncoder(str(tiny / "clip"))
    with torch.no_grad():
        model.model.visual_projection.weight.mul_(-1.5)
    (run / "train_gtr").mkdir(parents=True)
    torch.save(model.state_dict(), run / "train_gtr" / "model.pt")
    _write_train_manifest(run, "gtr", "cd" * 32, demo, demo.models,
                          ModelSpec(backend="transformers-clip", model_id=str(tiny / "clip")))
    student = _load(f"student:{run / 'train_gtr' / 'model.pt'}", demo)
    images = random_images(3, seed=5)
    model.eval()
    with torch.no_grad():
        want_image = model.encode_image(model.pixel_values(images)).numpy()
        want_text = model.encode_text(model.tokens(TEXTS)).numpy()
    np.testing.assert_allclose(student.encode_image(images), want_image, atol=1e-5)
    np.testing.assert_allclose(student.encode_text(TEXTS), want_text, atol=1e-5)
    base = _load(f"transformers-clip:{tiny / 'clip'}", demo)
    assert not np.allclose(student.encode_image(images), base.encode_image(images), atol=1e-3)  # the trained weights
    assert retriever_lineage(parse_retriever(f"student:{run}"), demo)["base_model"]["model_id"] == str(tiny / "clip")
    with pytest.raises(RetrieverError, match="no trained model under"):
        _load(f"student:{tmp_path}/train-gtr/demo/train_gtr_log", demo)


# --- scores files ----------------------------------------------------------------------------------------


def _matrix() -> tuple[list[str], list[str], np.ndarray]:
    rng = np.random.default_rng(7)
    scores = rng.normal(size=(4, 6)).astype(np.float32)
    scores[0, :3] = np.float32(0.1)  # ties
    scores[1, 0], scores[2, 1] = np.float32(1e-38), np.float32(-3.4e38)  # near the ends of float32
    return [f"q{k}" for k in range(4)], [f"img-{k:03d}" for k in range(6)], scores


@pytest.mark.parametrize("form", ["trec", "parquet"])
def test_scores_round_trip_exactly(tmp_path: Path, form: str) -> None:
    queries, items, scores = _matrix()
    path = tmp_path / f"run.{form}"
    if form == "trec":
        assert write_trec_run(path, ranked_rows(queries, items, scores), tag="tiny") == scores.size
    else:
        assert write_scores_parquet(path, queries, items, scores) == scores.size
    found = read_scores(path, queries, items)
    assert found.format == form and found.rows == scores.size
    back = found.matrix(len(queries), len(items))
    assert back.dtype == np.float64 and np.array_equal(back, scores.astype(np.float64))
    assert np.array_equal(back.astype(np.float32), scores)
    assert found.unknown_queries.rows == found.unknown_items.rows == 0
    if form == "trec":
        assert found.tags == ("tiny",)
        first = path.read_text().splitlines()[0].split()
        assert first[:2] == ["q0", "Q0"] and first[3] == "1"


def test_scores_unknown_rows_are_counted_and_the_rest_read(tmp_path: Path) -> None:
    path = tmp_path / "run.trec"
    path.write_text("q1 Q0 a 1 0.5 x\nq1 Q0 zz 2 0.4 x\n\nq9 Q0 a 1 0.9 x\nq8 Q0 b 1 0.8 x\nq9 Q0 zz 2 0.1 x\n"
                    "q2 Q0 b 1 -1.25 x\n")
    found = read_scores(path, ["q1", "q2"], ["a", "b"])
    assert found.rows == 6 and len(found.frame) == 2
    assert list(found.triples()) == [("q1", "a", 0.5), ("q2", "b", -1.25)]
    assert (found.unknown_queries.rows, found.unknown_queries.distinct, found.unknown_queries.examples) == \
        (3, 2, ("q9", "q8"))
    assert (found.unknown_items.rows, found.unknown_items.distinct, found.unknown_items.examples) == (2, 1, ("zz",))
    assert found.stats()["unknown_queries"] == 2 and "3 naming 2 unknown queries (e.g. q9, q8)" in found.summary()
    parquet = tmp_path / "run.parquet"
    write_scores_parquet(parquet, ["q1", "q7"], ["a", "b"], np.array([[1.0, np.nan], [2.0, 3.0]]))
    found = read_scores(parquet, ["q1"], ["a", "b"])
    assert found.rows == 3 and list(found.triples()) == [("q1", "a", 1.0)] and found.unknown_queries.rows == 2


@pytest.mark.parametrize(("content", "says"), [
    ("q1 Q0 a 1 0.5 x\nq1 Q0 a 2 0.4 x\n", "1 duplicate (query, item) rows, e.g. (q1, a)"),
    ("q9 Q0 a 1 0.5 x\nq1 Q0 zz 2 0.4 x\n", "none of its 2 rows names a query and an item"),
    ("q1 Q0 a 1 0.5\n", "line 1 has 5 fields"),
    ("q1 Q0 a one 0.5 x\n", "line 1: rank 'one' or score '0.5' is not a number"),
    ("q1 Q0 a 1 nan x\n", "1 NaN scores"),
    ("", "no rows"),
])
def test_a_bad_scores_file_is_one_line(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "run.trec"
    path.write_text(content)
    with pytest.raises(ScoresFileError) as err:
        read_scores(path, ["q1"], ["a"])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_parquet_without_the_columns_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"qid": ["q1"], "item_id": ["a"], "score": [1.0]}), tmp_path / "s.parquet")
    with pytest.raises(ScoresFileError, match=r"columns \['query_id'\] missing"):
        read_scores(tmp_path / "s.parquet", ["q1"], ["a"])


# --- lineage ----------------------------------------------------------------------------------------------


def test_lineage_follows_content(tmp_path: Path, demo) -> None:
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("x")
    spec = parse_retriever(f"transformers-clip:{folder}")
    before = retriever_lineage(spec, demo)
    (folder / ".cache" / "download.lock").write_text("changed")  # hidden: not content
    assert retriever_lineage(spec, demo) == before
    (folder / "config.json").write_text("[]")  # the same size: only the hash tells
    assert retriever_lineage(spec, demo)["content"]["sha256"] != before["content"]["sha256"]
    assert retriever_lineage(parse_retriever("transformers-clip:openai/clip-vit-base-patch32"), demo)["hub_id"] == \
        "openai/clip-vit-base-patch32"
    big = folder / "weights.safetensors"
    with big.open("wb") as handle:  # sparse: 65 MiB by size, head and tail, not read whole
        handle.truncate(65 * 1024 * 1024)
    with_big = retriever_lineage(spec, demo)["content"]
    os.utime(big, ns=(10**18, 10**18))  # another copy's time stamp: the same weights
    assert retriever_lineage(spec, demo)["content"] == with_big
    with big.open("r+b") as handle:  # another header: other weights
        handle.write(b"{}")
    assert retriever_lineage(spec, demo)["content"]["sha256"] != with_big["sha256"]
    copy = tmp_path / "elsewhere"  # the same folder under another path: the same fingerprint
    shutil.copytree(folder, copy)
    assert retriever_lineage(parse_retriever(f"transformers-clip:{copy}"), demo)["content"] == \
        retriever_lineage(spec, demo)["content"]

    module = tmp_path / "user_model.py"
    module.write_text("def make(): pass\n")
    python = parse_retriever(f"python:{module}:make")
    first = retriever_lineage(python, demo)
    module.write_text("def make(): return 1\n")
    assert retriever_lineage(python, demo)["file_sha256"] != first["file_sha256"] and first["factory"] == "make"

    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 a 1 0.5 x\n")
    scores = parse_retriever(f"scores:{run}")
    first = retriever_lineage(scores, demo)
    run.write_text("q1 Q0 a 1 0.25 x\n")
    assert retriever_lineage(scores, demo)["sha256"] != first["sha256"]
    with pytest.raises(RetrieverError, match="no such file or folder"):
        retriever_lineage(parse_retriever(f"scores:{tmp_path / 'absent.trec'}"), demo)


def test_spec_is_a_value() -> None:
    spec = parse_retriever("expert:attributes")
    assert spec == RetrieverSpec("expert:attributes", "expert", "attributes") and len({spec, spec}) == 1


def test_unit_rows_keep_a_normalised_model_bit_for_bit() -> None:
    """Exact ties (an attribute expert's discrete scores) are broken by gallery order: a vector that
    is unit already must reach the ranking unchanged, or a last-bit change could reorder ties."""
    from rde.evaluation.retriever_loading import unit_rows

    rng = np.random.default_rng(0)
    unit = rng.normal(size=(5, 7)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    raw = np.vstack([unit, 3 * unit[:1], np.zeros((1, 7), np.float32)])
    out = unit_rows(raw)
    assert np.array_equal(out[:5], unit) and np.array_equal(out[6], np.zeros(7, np.float32))
    assert np.linalg.norm(out[5]) == pytest.approx(1.0, abs=1e-6)
