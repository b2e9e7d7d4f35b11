"""Healthy trainings of the models people train, small enough to run dozens of steps in seconds.

Each family builds a model (from a small config for ``transformers`` models: random
initialisation, nothing downloaded), its optimizer, and a task it can learn; :func:`train` runs
it. ``tests/test_zoo.py`` attaches the default rules to each and expects not a single hit.

>>> losses = train(FAMILIES["bert"](), steps=30)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

BATCH = 8
SEQ = 16


@dataclass
class Training:
    """A model, its optimizer, and one step's loss: ``loss(step)`` runs the forward pass."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[int], torch.Tensor]
    clip: float | None = None
    """Gradient norm clipping between backward and the optimizer step, when set."""


def train(run: Training, steps: int, session=None) -> list[float]:
    """Train ``run`` for ``steps`` steps; the loss goes to ``session.observe`` when given."""
    losses = []
    for step in range(steps):
        loss = run.loss(step)
        if session is not None:
            session.observe("loss", loss)
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if run.clip is not None:
            nn.utils.clip_grad_norm_(run.model.parameters(), run.clip)
        run.optimizer.step()
        losses.append(loss.item())
    return losses


def _counting(g: torch.Generator, vocab: int) -> torch.Tensor:
    """Sequences counting upward from a random start: a language a small model learns fast."""
    start = torch.randint(0, vocab, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ)) % vocab


def _topics(g: torch.Generator, vocab: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences whose words come from one of ``classes`` slices of the vocabulary: the label."""
    labels = torch.randint(0, classes, (BATCH,), generator=g)
    width = vocab // classes
    words = torch.randint(0, width, (BATCH, SEQ), generator=g)
    return words + labels[:, None] * width, labels


def _adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


# --- transformers, built from small configs ------------------------------------------------


def _transformers():
    import pytest

    return pytest.importorskip("transformers")


def bert() -> Training:
    """An encoder: BertForSequenceClassification tells which slice of the vocabulary a
    sequence's words come from."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=SEQ, num_labels=3)  # fmt: skip
    model = tf.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        ids, labels = _topics(g, 1000, 3)
        return model(input_ids=ids, labels=labels).loss

    return Training(model, _adamw(model), loss)


def gpt2() -> Training:
    """A decoder: GPT2LMHeadModel (its head shares the token embedding) on counting sequences."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=1000, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        ids = _counting(g, 1000)
        return model(input_ids=ids, labels=ids).loss

    return Training(model, _adamw(model), loss)


def _copying(model: nn.Module, first_token: int) -> Callable[[int], torch.Tensor]:
    """An encoder-decoder's loss on learning to copy its input (made of 50 of its words)."""
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        ids = torch.randint(first_token, first_token + 50, (BATCH, SEQ // 2), generator=g)
        return model(input_ids=ids, labels=ids).loss

    return loss


def t5() -> Training:
    """An encoder-decoder: T5ForConditionalGeneration (relative position biases, RMS norms, no
    biases in its projections) learning to copy."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=1000, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                         num_heads=2, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = tf.T5ForConditionalGeneration(config)
    return Training(model, _adamw(model), _copying(model, first_token=1))


def bart() -> Training:
    """An encoder-decoder: BartForConditionalGeneration (biased projections in self- and
    cross-attention) learning to copy."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BartConfig(vocab_size=1000, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_position_embeddings=SEQ)  # fmt: skip
    model = tf.BartForConditionalGeneration(config)
    return Training(model, _adamw(model), _copying(model, first_token=3))


def _tinted(g: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images tinted red, green or blue: the tint is the class."""
    labels = torch.randint(0, 3, (BATCH,), generator=g)
    images = torch.randn(BATCH, 3, size, size, generator=g)
    images[torch.arange(BATCH), labels] += 1.0
    return images, labels


def vit() -> Training:
    """A vision transformer: ViTForImageClassification on 32x32 images."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          num_labels=3)  # fmt: skip
    model = tf.ViTForImageClassification(config)
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        images, labels = _tinted(g, 32)
        return model(pixel_values=images, labels=labels).loss

    return Training(model, _adamw(model), loss)


# --- a word language model with a large embedding table ----------------------------------------


class WordLM(nn.Module):
    """pytorch/examples' word language model, smaller: an embedding table over a large
    vocabulary, an LSTM, and a decoder back to the vocabulary."""

    def __init__(self, vocab: int, dim: int, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        # The example's initialisation.
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.drop(self.encoder(tokens)))
        return self.decoder(self.drop(hidden))


def word_lm(vocab: int = 33278, used: int = 1000) -> Training:
    """The example's recipe (SGD at learning rate 20, gradients clipped to 0.25) and its
    vocabulary size (WikiText-2's 33,278 words), on text whose words follow Zipf's law over the
    first ``used`` words: each step touches about a hundred rows of the table and leaves the
    others without a gradient, so mean |grad| over the table is below 1e-7 on most steps."""
    torch.manual_seed(0)
    model = WordLM(vocab, 32)
    g = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, used + 1, dtype=torch.float64)

    def loss(step: int) -> torch.Tensor:
        tokens = torch.multinomial(zipf, BATCH * (SEQ + 1), replacement=True, generator=g)
        tokens = tokens.view(BATCH, SEQ + 1)
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Training(model, torch.optim.SGD(model.parameters(), lr=20.0), loss, clip=0.25)


# --- convolutional networks with batch normalisation -------------------------------------------


class BasicBlock(nn.Module):
    """A ResNet basic block as torchvision writes it: 3x3 convolutions without bias, each
    followed by BatchNorm, and a 1x1 projection on the shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """A small ResNet in torchvision's layout (stem, stages of basic blocks, pooling, fc), with
    torchvision's initialisation. ``conv_bias`` gives the stem convolution a bias before its
    BatchNorm, as many hand-written CNNs do: BatchNorm subtracts the batch mean, so that bias
    gets no gradient (up to rounding)."""

    def __init__(self, classes: int = 3, width: int = 16, conv_bias: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=conv_bias)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(conv_bias: bool = False) -> Training:
    """The small ResNet on 16x16 images: SGD with momentum 0.9 and weight decay 1e-4, as in
    torchvision's reference recipe, at a learning rate scaled down to a batch of 8."""
    torch.manual_seed(0)
    model = ResNet(conv_bias=conv_bias)
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        images, labels = _tinted(g, 16)
        return F.cross_entropy(model(images), labels)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    return Training(model, optimizer, loss)


# --- recurrent networks ----------------------------------------------------------------------


class LSTMClassifier(nn.Module):
    """A two-layer LSTM over token embeddings; the last state classifies the sequence."""

    def __init__(self, vocab: int = 300, dim: int = 32, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


def lstm() -> Training:
    """The LSTM classifier tells which slice of the vocabulary a sequence's words come from."""
    torch.manual_seed(0)
    model = LSTMClassifier()
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        tokens, labels = _topics(g, 300, 3)
        return F.cross_entropy(model(tokens), labels)

    return Training(model, torch.optim.Adam(model.parameters(), lr=3e-3), loss)


class Experts(nn.Module):
    """A mixture of experts with top-1 routing, as many write it: every expert is called on the
    tokens routed to it, an empty batch when none are (a step where an expert gets no token)."""

    def __init__(self, dim: int = 16, experts: int = 4, classes: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim)) for _ in range(experts)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        p = F.softmax(self.gate(h), -1)
        chosen, out = p.argmax(-1), torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            routed = chosen == e
            out[routed] = expert(h[routed]) * p[routed][:, e : e + 1]
        return self.head(h + out)


def experts() -> Training:
    """Three tokens a step among four experts: most steps leave one idle, called on nothing."""
    torch.manual_seed(0)
    model = Experts()
    g = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(3, 8, generator=g)
        return F.cross_entropy(model(x), (x[:, 0] > 0).long() + (x[:, 1] > 0).long())

    return Training(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss)


# --- the repository's own demo -----------------------------------------------------------------


def tiny_gpt() -> Training:
    """tensordbg's demo model with the demo's settings, on batches without the bad one."""
    from tensordbg.demo import PAD, VOCAB, TinyGPT, batches

    torch.manual_seed(0)
    model = TinyGPT()
    data = batches(10_000, bad_step=-1)

    def loss(step: int) -> torch.Tensor:
        tokens = next(data)
        logits = model(tokens[:, :-1])
        target = tokens[:, 1:].reshape(-1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), target, ignore_index=PAD)

    return Training(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss)


FAMILIES: dict[str, Callable[[], Training]] = {
    "bert": bert,
    "gpt2": gpt2,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "word_lm": word_lm,
    "resnet": resnet,
    "resnet_conv_bias": lambda: resnet(conv_bias=True),
    "lstm": lstm,
    "experts": experts,
    "tiny_gpt": tiny_gpt,
}
