"""The CLIP test-time methods against short transcriptions of their authors' code, in float64 on a
tiny open_clip model with random weights (16×16 images), the views drawn once and given to both
sides (the same generator state): TPT (azshue/TPT tpt_classification.py, clip/custom_clip.py),
ZERO (FarinaMatteo/zero ttas/zero.py), TDA (kdiAAA/TDA tda_runner.py, utils.py), DMN-ZS
(YBZh/DMN dmn_main.py, n_shot 0) and BoostAdapter (taolinzhang/BoostAdapter runner.py). Each
transcription follows the authors' logic (their dict caches, loops and sorts), not this tool's."""

from __future__ import annotations

import copy
import math
import operator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_clip

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.shared.zero_shot import with_views
from cafa_cli.model.clip import ClassTexts, PromptedTexts, ZeroShotClassifier, class_embeddings, zero_shot_classifier
from cafa_cli.model.features import FeatureClassifier

pytest.importorskip("open_clip")

NAMES = ("cat", "dog", "sea lion", "ship")
SEED = 3


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def clip_model(seed: int = 0):
    clip, tokenizer = tiny_clip(seed)
    return clip.double(), tokenizer


def spread(clip) -> ZeroShotClassifier:
    """A zero-shot classifier of the tiny CLIP whose classes its random image encoder tells
    apart: its embeddings of random images lie within a few degrees of each other, so its text
    embeddings predict one class for all; these class embeddings are four images' embeddings
    less their mean, at a temperature of 20."""
    with torch.no_grad():
        features = F.normalize(clip.visual(images(64, seed=9)), dim=-1)
    return ZeroShotClassifier(clip.visual, features[:4] - features.mean(0), 20.0)


def run(name: str, batches: list[torch.Tensor], seed: int = 0, **settings):
    """Ours: the method through an Adapter on the float64 tiny CLIP (TPT: its zero-shot
    classifier; the others: `spread`'s); its views from a generator seeded SEED. Returns the
    reported logits of each batch, the method and the classifier."""
    clip, tokenizer = clip_model(seed)
    texts = ClassTexts(clip, tokenizer, NAMES)
    classifier = (zero_shot_classifier(clip, texts) if name == "tpt" else spread(clip)).double()
    options = settings.pop("options", {})
    method = create(name, **options)
    method.generator = torch.Generator().manual_seed(SEED)
    adapter = Adapter(FeatureClassifier(classifier), method, **settings)
    return [adapter.step(images) for images in batches], method, classifier


def viewed(stream: list[torch.Tensor], count: int, augment: str = "crop") -> list[torch.Tensor]:
    """Each image's views as the authors' loader gives them, [the image, view 1, …], one image
    after the other: the draw ours makes (the same generator, batch after batch)."""
    generator = torch.Generator().manual_seed(SEED)
    made = [with_views(batch, count, augment, generator) for batch in stream]
    return [each for batch in made for each in batch.view(-1, 1 + count, *batch.shape[1:])]


def encode(clip, images):  # the authors' get_image_features / encode_image, then normalised
    with torch.no_grad():
        features = clip.encode_image(images)
    return features / features.norm(dim=-1, keepdim=True)


def avg_entropy(outputs):  # TPT's, TDA's, DMN's
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg_logits = logits.logsumexp(dim=0) - np.log(logits.shape[0])
    avg_logits = torch.clamp(avg_logits, min=torch.finfo(avg_logits.dtype).min)
    return -(avg_logits * torch.exp(avg_logits)).sum(dim=-1)


def select_confident_samples(logits, top):  # TPT's
    batch_entropy = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
    idx = torch.argsort(batch_entropy, descending=False)[: int(batch_entropy.size()[0] * top)]
    return logits[idx], idx


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


# --- TPT ---


class PromptLearnerTPT(torch.nn.Module):
    """TPT's PromptLearner and TextEncoder (clip/custom_clip.py), class token at the end."""

    def __init__(self, clip, tokenizer, classnames, ctx_init="a photo of a"):
        super().__init__()
        self.clip = clip
        n_ctx = len(ctx_init.split(" "))
        with torch.no_grad():
            ctx_vectors = clip.token_embedding(tokenizer(ctx_init))[0, 1 : 1 + n_ctx, :]
            self.tokenized_prompts = tokenizer([ctx_init + " " + name + "." for name in classnames])
            embedding = clip.token_embedding(self.tokenized_prompts)
        self.ctx_init_state = ctx_vectors.detach().clone()
        self.ctx = torch.nn.Parameter(ctx_vectors.clone())
        self.token_prefix, self.token_suffix = embedding[:, :1, :], embedding[:, 1 + n_ctx :, :]

    def reset(self):
        with torch.no_grad():
            self.ctx.copy_(self.ctx_init_state)

    def text_features(self):
        ctx = self.ctx.unsqueeze(0).expand(len(self.token_prefix), -1, -1)
        x = torch.cat([self.token_prefix, ctx, self.token_suffix], dim=-2) + self.clip.positional_embedding
        x = self.clip.ln_final(self.clip.transformer(x, attn_mask=self.clip.attn_mask))
        x = x[torch.arange(x.shape[0]), self.tokenized_prompts.argmax(dim=-1)] @ self.clip.text_projection
        return x / x.norm(dim=-1, keepdim=True)


def tpt_reference(stream, scale, lr=5e-3, steps=1, top=0.1, count=7):
    clip, tokenizer = clip_model()
    learner = PromptLearnerTPT(clip, tokenizer, NAMES)
    optimizer = torch.optim.AdamW([learner.ctx], lr)
    optim_state = copy.deepcopy(optimizer.state_dict())
    outputs = []
    for inputs in viewed(stream, count):
        with torch.no_grad():
            learner.reset()
        optimizer.load_state_dict(optim_state)
        image_features = encode(clip, inputs)
        selected_idx = None
        for _ in range(steps):  # test_time_tuning
            output = scale * image_features @ learner.text_features().t()
            if selected_idx is not None:
                output = output[selected_idx]
            else:
                output, selected_idx = select_confident_samples(output, top)
            loss = avg_entropy(output)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            outputs.append(scale * image_features[:1] @ learner.text_features().t())
    return torch.cat(outputs), learner.ctx.detach()


@pytest.mark.parametrize("steps", [1, 2])
def test_tpt_is_its_authors_prompt_tuning(float64, steps):
    stream = [images(2), images(1, seed=2)]
    ours, method, classifier = run(
        "tpt", stream, optimizer="adamw", lr=5e-3, steps=steps, options={"views": 7, "share": 0.3}
    )
    theirs, ctx = tpt_reference(stream, classifier.logit_scale, steps=steps, top=0.3)
    torch.testing.assert_close(torch.cat(ours), theirs.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(method.prompts.ctx.detach(), ctx, rtol=0, atol=1e-12)  # the last image's
    assert (ctx - method.prompts.ctx_init).abs().max() > 1e-3  # the prompt moved


def test_the_prompt_module_starts_as_the_single_templates_class_embeddings():
    """CoOp's [SOS] + context + name through the text tower, context from "a photo of a": the
    embeddings of open_clip's encode_text of "a photo of a NAME.", bit for bit, and
    class_embeddings' of the one template to the rounding of its second normalisation."""
    clip, tokenizer = tiny_clip()
    texts = ClassTexts(clip, tokenizer, NAMES)
    prompts = PromptedTexts(texts)
    assert prompts.ctx.shape == (4, 32) and prompts.ctx.requires_grad
    assert not any(p.requires_grad for name, p in prompts.named_parameters() if name != "ctx")
    with torch.no_grad():
        made = prompts()
        own = F.normalize(clip.encode_text(tokenizer([f"a photo of a {name}." for name in NAMES])), dim=-1)
    assert torch.equal(made, own)
    torch.testing.assert_close(made, class_embeddings(texts), rtol=0, atol=3e-7)


# --- ZERO ---


def greedy_break(ties, logits):  # utils/tools.py, as the authors meant its fallback
    preds = torch.argmax(logits, dim=1)
    for pred in preds:
        if pred in ties:
            return pred
    return ties[logits[0, ties].argmax()]


def zero(logits, temp, gamma):  # ttas/zero.py's zero(), from the views' unscaled logits
    p = (logits / temp).softmax(1)
    batch_entropy = -(p * p.log()).sum(1)  # confidence_filter
    sorted_idx = torch.argsort(batch_entropy, descending=False)
    l_filt = logits[sorted_idx[: int(batch_entropy.size()[0] * gamma)]]
    p_bar = (l_filt / torch.finfo(l_filt.dtype).eps).softmax(1).sum(0)
    max_counts, scalar_pred = torch.max(p_bar, dim=-1)
    ties = [scalar_pred] + [i for i in range(len(p_bar)) if i != scalar_pred and p_bar[i] == max_counts]
    if len(ties) > 1:
        k = int(logits.size(0) * gamma)
        scalar_pred = greedy_break(torch.tensor(ties), logits[sorted_idx][k:])
        p_bar[scalar_pred] += 1
    return p_bar


def zero_reference(stream, text, scale, gamma=0.3, count=15):
    clip, _ = clip_model()
    return torch.stack([zero(encode(clip, inputs) @ text.t(), 1 / scale, gamma) for inputs in viewed(stream, count)])


def test_zero_breaks_a_tie_as_its_authors(float64):
    """Four confident views voting 2-2: the next most confident view whose class is tied wins."""
    from cafa_cli.methods.zero import votes

    logits = torch.tensor([[3.0, 0, 0], [0, 2.9, 0], [2.8, 0, 0], [0, 2.7, 0], [0, 0, 0.5], [0, 0.4, 0], [0.3, 0, 0]])
    ours, theirs = votes(logits, 1.0, 0.6), zero(logits, 1.0, 0.6)
    assert theirs.tolist() == [2, 3, 0] and torch.equal(ours, theirs)


def test_zero_is_its_authors_vote_of_confident_views(float64):
    stream = [images(4), images(3, seed=2)]
    ours, _, classifier = run("zero", stream, options={"views": 15})
    text = classifier.head.weight / classifier.logit_scale
    theirs = zero_reference(stream, text, classifier.logit_scale)
    shares = torch.cat(ours).double().exp()
    torch.testing.assert_close(shares, theirs / theirs.sum(1, keepdim=True), rtol=0, atol=1e-6)
    assert len({tuple(row.tolist()) for row in theirs}) > 2  # the votes differ from image to image


# --- TDA and BoostAdapter ---


def update_cache(cache, pred, features_loss, shot_capacity, include_prob_map=False):  # TDA's
    item = features_loss if not include_prob_map else features_loss[:2] + [features_loss[2]]
    if pred in cache:
        if len(cache[pred]) < shot_capacity:
            cache[pred].append(item)
        elif features_loss[1] < cache[pred][-1][1]:
            cache[pred][-1] = item
        cache[pred] = sorted(cache[pred], key=operator.itemgetter(1))
    else:
        cache[pred] = [item]


def update_cache_sorted(cache, pred, features_loss, shot_capacity):  # BoostAdapter's, fifo False
    if pred in cache:
        cache[pred].append(features_loss)
        cache[pred] = sorted(cache[pred], key=operator.itemgetter(1))[:shot_capacity]
    else:
        cache[pred] = [features_loss]


def compute_cache_logits(image_features, cache, alpha, beta, classes, neg_mask_thresholds=None):
    cache_keys, cache_values = [], []
    for class_index in sorted(cache.keys()):
        for item in cache[class_index]:
            cache_keys.append(item[0])
            cache_values.append(item[2] if neg_mask_thresholds else class_index)
    cache_keys = torch.cat(cache_keys, dim=0).permute(1, 0)
    if neg_mask_thresholds:
        cache_values = torch.cat(cache_values, dim=0)
        cache_values = ((cache_values > neg_mask_thresholds[0]) & (cache_values < neg_mask_thresholds[1])).double()
    else:
        cache_values = F.one_hot(torch.tensor(cache_values), num_classes=classes).double()
    affinity = image_features @ cache_keys
    return alpha * ((-1) * (beta - beta * affinity)).exp() @ cache_values


def get_clip_logits(images, clip, head):  # utils.py; clip_logits: the model's s·t for the authors' 100·t
    image_features = encode(clip, images)
    clip_logits = image_features @ head.t()
    if image_features.size(0) > 1:
        batch_entropy = -(clip_logits.softmax(1) * clip_logits.log_softmax(1)).sum(1)
        selected_idx = torch.argsort(batch_entropy, descending=False)[: int(batch_entropy.size()[0] * 0.1)]
        output = clip_logits[selected_idx]
        image_features = image_features[selected_idx].mean(0).unsqueeze(0)
        clip_logits = output.mean(0).unsqueeze(0)
        loss, prob_map = avg_entropy(output), output.softmax(1).mean(0).unsqueeze(0)
        pred = int(output.mean(0).unsqueeze(0).topk(1, 1, True, True)[1].t())
    else:
        loss = -(clip_logits.softmax(1) * clip_logits.log_softmax(1)).sum(1)
        prob_map = clip_logits.softmax(1)
        pred = int(clip_logits.topk(1, 1, True, True)[1].t()[0])
    return image_features, clip_logits, loss, prob_map, pred


POS = {"shot_capacity": 3, "alpha": 2.0, "beta": 5.0}
NEG = {"shot_capacity": 2, "alpha": 0.117, "beta": 1.0, "entropy": (0.2, 0.5), "mask": (0.03, 1.0)}


def tda_reference(stream, head, count, boost=False, delta=3, neg=NEG):
    clip, _ = clip_model()
    classes = head.shape[0]
    pos_cache, neg_cache, out = {}, {}, []
    for inputs in viewed(stream, count) if count else torch.cat(stream).split(1):
        image_features, clip_logits, loss, prob_map, pred = get_clip_logits(inputs, clip, head)
        prop_entropy = float(loss / math.log2(classes))  # get_entropy
        if boost:
            update_cache_sorted(pos_cache, pred, [image_features, loss], POS["shot_capacity"])
            ori_feat = encode(clip, inputs)
            ori_output = ori_feat @ head.t()
            _, idx = select_confident_samples(ori_output, 0.1)
            cur_pos_cache = copy.deepcopy(pos_cache)
            for i in idx:
                logits = ori_output[i] - ori_output[i].logsumexp(dim=-1, keepdim=True)  # get_output_entropy
                entropy = -(logits * torch.exp(logits)).sum(dim=-1)
                cur = [ori_feat[i].unsqueeze(0), entropy.item()]
                update_cache_sorted(cur_pos_cache, int(ori_output[i].argmax()), cur, POS["shot_capacity"] + delta)
        else:
            update_cache(pos_cache, pred, [image_features, loss], POS["shot_capacity"])
            cur_pos_cache = pos_cache
        if neg["entropy"][0] < prop_entropy < neg["entropy"][1]:
            update_cache(neg_cache, pred, [image_features, loss, prob_map], neg["shot_capacity"], True)
        final_logits = clip_logits.clone()
        final_logits += compute_cache_logits(image_features, cur_pos_cache, POS["alpha"], POS["beta"], classes)
        if neg_cache:
            final_logits -= compute_cache_logits(
                image_features, neg_cache, neg["alpha"], neg["beta"], classes, neg["mask"]
            )
        out.append(final_logits)
    return torch.cat(out), neg_cache


# entropy bounds that the tiny model's 4-class predictions fall within, so that both caches fill
WIDE = {**NEG, "entropy": (0.05, 0.95)}


@pytest.mark.parametrize("count", [0, 9])
def test_tda_is_its_authors_positive_and_negative_caches(float64, count):
    stream = [images(6), images(5, seed=2), images(6, seed=3)]
    options = {"views": count, "augment": "crop", "entropy_lower": 0.05, "entropy_upper": 0.95}
    ours, method, classifier = run("tda", stream, options=options)
    theirs, neg_cache = tda_reference(stream, classifier.head.weight, count, neg=WIDE)
    torch.testing.assert_close(torch.cat(ours), theirs.float(), rtol=0, atol=2e-5)
    assert sum(map(len, neg_cache.values())) >= 3  # the negative cache took part
    assert int(torch.isfinite(method.positive.entropies).sum()) >= 5


def test_boostadapter_is_its_authors_boosted_caches(float64):
    stream = [images(5), images(5, seed=2)]
    # one boosting sample a class beyond the positive cache's 3, so that the samples compete by entropy
    options = {"views": 19, "entropy_lower": 0.05, "entropy_upper": 0.95, "boost_shots": 1}
    ours, _, classifier = run("boostadapter", stream, options=options)
    theirs, _ = tda_reference(stream, classifier.head.weight, 19, boost=True, delta=1, neg=WIDE)
    torch.testing.assert_close(torch.cat(ours), theirs.float(), rtol=0, atol=2e-5)
    options.pop("boost_shots")
    tda, _, _ = run("tda", stream, options={**options, "augment": "crop"})
    assert (torch.cat(tda) - theirs.float()).abs().max() > 1e-2  # the boosting samples count


# --- DMN-ZS ---


def dmn_reference(stream, head, scale, count=7, memory_size=3, beta=5.5, weight=1.0, top=0.1):
    clip, _ = clip_model()
    text_feat = head / scale
    classes, dim = text_feat.shape
    image_feature_memory = torch.zeros(classes, memory_size, dim)
    image_entropy_mem = torch.zeros(classes, memory_size)
    image_feature_count = torch.zeros(classes, 1).long()
    out = []
    for inputs in viewed(stream, count):
        image_features_global = encode(clip, inputs)
        img_text = (scale * image_features_global @ text_feat.t()).softmax(-1)  # get_text_prediction
        batch_entropy = -(img_text * torch.log(img_text + 1e-6)).sum(1)  # select_confident_samples
        idx = torch.argsort(batch_entropy, descending=False)[: int(batch_entropy.size()[0] * top)]
        mean_prob = img_text[idx].mean(0, keepdim=True)[0]
        pseudo_label = mean_prob.max(0)[1].item()  # update_memory_bank
        current_instance_entropy = -(mean_prob * (torch.log(mean_prob + 1e-8))).sum()
        if image_feature_count[pseudo_label] == memory_size:
            if (current_instance_entropy < image_entropy_mem[pseudo_label]).sum() != 0:
                to_replace = torch.sort(image_entropy_mem[pseudo_label])[1][-1]
                image_feature_memory[pseudo_label][to_replace] = image_features_global[:1]
                image_entropy_mem[pseudo_label][to_replace] = current_instance_entropy
        else:
            image_feature_memory[pseudo_label][image_feature_count[pseudo_label, 0].item()] = image_features_global[:1]
            image_entropy_mem[pseudo_label][image_feature_count[pseudo_label, 0].item()] = current_instance_entropy
            image_feature_count[pseudo_label] += 1
        img_feat = image_features_global[:1]  # get_image_pred, similarity_weighted, zero biases
        memorized = torch.cat((image_feature_memory, text_feat.unsqueeze(1)), dim=1)
        keys = memorized / memorized.norm(dim=-1, keepdim=True)
        keys[memorized.sum(-1) == 0] = 0
        query = img_feat / img_feat.norm(dim=-1, keepdim=True)
        similarity = torch.exp(-beta * (-(query * keys).sum(-1) + 1))
        adaptive = (keys * similarity.unsqueeze(-1)).sum(1)
        adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)
        adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)
        img_global_pred = (scale * adaptive @ img_feat.unsqueeze(-1))[:, :, 0].softmax(dim=1)
        out.append(img_text[:1] * 1.0 + img_global_pred * weight)
    return torch.cat(out), image_feature_count


def test_dmn_zs_is_its_authors_dynamic_memory(float64):
    stream = [images(6), images(6, seed=2), images(5, seed=3)]
    ours, _, classifier = run("dmn-zs", stream, options={"views": 7, "memory": 3, "share": 0.3})
    theirs, counts = dmn_reference(stream, classifier.head.weight, classifier.logit_scale, top=0.3)
    torch.testing.assert_close(torch.cat(ours).double().exp() * 2, theirs, rtol=0, atol=1e-6)
    assert int(counts.max()) == 3  # some class's memory filled, and its entries were replaced
