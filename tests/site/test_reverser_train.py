"""The digit reverser of page 6b trained in the browser (docs/javascripts/reverser-train.js), in headless Chromium.

- The JavaScript loss and the gradient of every parameter equal torch's (float64, the page's
  ``Reverser`` with attention_ref's ``MultiHeadAttention``) for the same weights and batch, to
  ``GRAD_TOL`` absolute, with 1, 2 and 4 heads, positions on and off, and a sequence shorter than 8.
- A seeded run repeats in Python: mulberry32 written here gives the script's initial weights and
  batches, and torch's Adam (float64) from those weights gives the script's first losses to
  ``LOSS_TOL``.
- Train with the defaults, pressed like a reader, brings the loss below ``TRAINED_LOSS`` within
  ``TRAIN_BUDGET_S`` seconds and the probe's map onto the anti-diagonal; the reader's own digits
  are then reversed. Without positions the loss stays high (page 6b's Exercise 4).
- Stop stops, Train goes on, Reset goes back to step 0 with no loss; the controls are reached by
  Tab and work by keyboard; the widget fits a 390 px page; the text reads at 4.5:1 and the curve
  at 3:1 in both schemes; no console error.
Fixtures (``site_url``, ``page``, ``open_page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_char_lm import IN_SCHEME, _contrast
from torch import nn

from attention_ref import MultiHeadAttention

PAGE = "tutorial/06b-watch-attention-learn/"
WIDGET = "div.reverser-train"
V, L, d, F = 10, 8, 32, 128
#: the largest |JS - torch| of the loss and of any gradient entry (both float64)
GRAD_TOL = 1e-9
#: the largest |JS - torch| of the first losses of a seeded run
LOSS_TOL = 1e-6
#: what the defaults (150 steps, lr 3e-3, 1 head, positions, seed 0) reach, and how fast here
TRAINED_LOSS = 0.1
TRAIN_BUDGET_S = 60.0
PROBE = [3, 1, 4, 1, 5, 9, 2, 6]


class Reverser(nn.Module):
    """Page 6b's model, with the heads and the positions as arguments."""

    def __init__(self, heads: int = 1, positions: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.pos = nn.Embedding(L, d) if positions else None
        self.norm1 = nn.LayerNorm(d)
        self.attn = MultiHeadAttention(embed_dim=d, num_heads=heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, F), nn.ReLU(), nn.Linear(F, d))
        self.norm3 = nn.LayerNorm(d)
        self.unembed = nn.Linear(d, V)

    def forward(self, seq):
        x = self.embed(seq)
        if self.pos is not None:
            x = x + self.pos.weight[: seq.shape[1]]
        a, w = self.attn(self.norm1(x), return_weights=True)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return self.unembed(self.norm3(x)), w


def loss_of(model, x, y):
    logits, _ = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


# ---- mulberry32 and the script's initialisation, in Python ---------------------------------------

M32 = 0xFFFFFFFF


def mulberry32(seed: int):
    """The script's generator: uniform floats in [0, 1), multiples of 2**-32."""
    a = seed & M32

    def draw() -> float:
        nonlocal a
        a = (a + 0x6D2B79F5) & M32
        t = a
        t = ((t ^ (t >> 15)) * (t | 1)) & M32
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & M32)) & M32
        return ((t ^ (t >> 14)) & M32) / 2**32

    return draw


def initial_weights(model: Reverser, seed: int) -> None:
    """The script's `Model.init`: in parameter order, embeddings N(0, 1) by Box-Muller, a Linear's
    weight then bias U(-k, k) with k = 1/sqrt(fan_in), LayerNorm 1 and 0."""
    draw = mulberry32(seed)
    fan_in = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if name in ("embed.weight", "pos.weight"):
                for i in range(flat.numel()):
                    u1, u2 = draw(), draw()
                    flat[i] = math.sqrt(-2 * math.log(1 - u1)) * math.cos(2 * math.pi * u2)
            elif name.startswith("norm"):
                flat.fill_(1.0 if name.endswith(".weight") else 0.0)
            else:
                if name.endswith(".weight"):
                    fan_in = p.shape[1]
                k = 1 / math.sqrt(fan_in)
                for i in range(flat.numel()):
                    flat[i] = (2 * draw() - 1) * k


def batches(seed: int, size: int = 64):
    """The script's stream of batches: mulberry32(seed ^ 0x9e3779b9), digit floor(10 u)."""
    draw = mulberry32(seed ^ 0x9E3779B9)
    while True:
        x = torch.tensor([[math.floor(draw() * V) for _ in range(L)] for _ in range(size)])
        yield x, x.flip(-1)


# ---- helpers --------------------------------------------------------------------------------------


def open_widget(page, site_url: str):
    page.goto(site_url + PAGE)
    widget = page.locator(WIDGET).first
    widget.wait_for()
    page.wait_for_function("sel => document.querySelector(sel)?.dataset.loaded === '1'", arg=WIDGET)
    return widget


def step_of(widget) -> int:
    return int(widget.get_attribute("data-step"))


def probe_map(widget) -> torch.Tensor:
    """The probe's map as drawn: the first map's cells, (L, S)."""
    cells = widget.locator("svg.revtrain-map").first.locator("rect.revtrain-cell")
    weights = cells.evaluate_all("cs => cs.map(c => Number(c.dataset.weight))")
    return torch.tensor(weights).view(L, L)


# ---- the numbers ----------------------------------------------------------------------------------

CASES = [(1, True, 8), (2, True, 8), (4, True, 8), (1, False, 8), (2, False, 8), (4, False, 8), (2, True, 5)]


def test_javascript_loss_and_gradients_equal_torch(page, site_url: str):
    page.goto(site_url + PAGE)
    page.wait_for_function("() => window.attentionRefReverser !== undefined")
    worst = {}
    for heads, positions, n in CASES:
        torch.manual_seed(heads * 10 + positions + n)
        model = Reverser(heads, positions).double()
        with torch.no_grad():  # away from torch's init: LayerNorm's weights and biases not 1 and 0
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        names = [name for name, _ in model.named_parameters()]
        js_names = page.evaluate("p => window.attentionRefReverser.shapes(p).map(s => s[0])", positions)
        assert js_names == names, "the script's parameters are not torch's, in torch's order"
        x = torch.randint(V, (5, n))
        y = torch.randint(V, (5, n))
        loss = loss_of(model, x, y)
        loss.backward()
        weights = {name: p.detach().tolist() for name, p in model.named_parameters()}
        got = page.evaluate(
            "([w, batch, config]) => window.attentionRefReverser.lossAndGrads(w, batch, config)",
            [weights, {"x": x.tolist(), "y": y.tolist()}, {"heads": heads, "positions": positions}],
        )
        gaps = {"loss": abs(got["loss"] - loss.item())}
        for name, p in model.named_parameters():
            js = torch.tensor(got["grads"][name], dtype=torch.float64).view_as(p)
            gaps[name] = float((js - p.grad).abs().max())
            assert p.grad.abs().max() > 0, (name, heads, positions)  # every gradient is tested on something
        name, gap = max(gaps.items(), key=lambda kv: kv[1])
        worst[(heads, positions, n)] = (name, gap)
    print("worst |JS - torch| per (heads, positions, length):", worst)
    bad = {case: w for case, w in worst.items() if w[1] > GRAD_TOL}
    assert not bad, f"gradients off torch's by more than {GRAD_TOL}: {bad}"
    assert not page.console_errors


@pytest.mark.parametrize(("seed", "heads", "positions"), [(0, 1, True), (7, 4, False)])
def test_a_seeded_run_repeats_in_torch(page, site_url: str, seed: int, heads: int, positions: bool):
    steps, lr = 5, 3e-3
    page.goto(site_url + PAGE)
    page.wait_for_function("() => window.attentionRefReverser !== undefined")
    got = page.evaluate("config => window.attentionRefReverser.run(config)",
                        {"seed": seed, "heads": heads, "positions": positions, "lr": lr, "steps": steps})
    model = Reverser(heads, positions).double()
    initial_weights(model, seed)
    for name, p in model.named_parameters():
        js = torch.tensor(got["initial"][name], dtype=torch.float64).view_as(p)
        assert torch.allclose(js, p.detach(), rtol=0, atol=1e-12), f"initial {name} differs"
    stream = batches(seed)
    first, _ = next(batches(seed))
    assert first.flatten().tolist() == got["firstBatch"]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x, y = next(stream)
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    gap = max(abs(a - b) for a, b in zip(got["losses"], losses))
    print(f"seed {seed}: torch {[round(v, 6) for v in losses]}, worst |JS - torch| {gap:.1e}")
    assert len(got["losses"]) == steps and gap < LOSS_TOL, (got["losses"], losses)
    assert losses[0] > losses[-1]


# ---- the widget -----------------------------------------------------------------------------------


def test_train_with_the_defaults_learns_within_its_budget(page, site_url: str):
    widget = open_widget(page, site_url)
    assert step_of(widget) == 0 and widget.locator("progress").get_attribute("max") == "150"
    before = probe_map(widget)
    start = time.monotonic()
    widget.get_by_role("button", name="Train").click()
    page.wait_for_function("sel => document.querySelector(sel).dataset.step === '150'"
                           " && document.querySelector(sel).dataset.training === '0'",
                           arg=WIDGET, timeout=1000 * TRAIN_BUDGET_S)
    seconds = time.monotonic() - start
    loss = float(widget.get_attribute("data-loss"))
    print(f"150 steps in {seconds:.1f} s, last loss {loss:.4f}")
    assert loss < TRAINED_LOSS
    assert widget.locator(".revtrain-count").text_content() == "step 150 / 150"
    assert widget.locator("progress").evaluate("p => [p.value, p.max]") == [150, 150]
    after = probe_map(widget)
    anti = after.flip(-1).diagonal().mean()
    assert before.flip(-1).diagonal().mean() < 0.3 and anti > 0.9, (before, after)
    assert torch.allclose(after.sum(-1), torch.ones(L), atol=1e-3)
    # the reader's digits, reversed
    widget.locator("input.revtrain-input").fill("31415926")
    assert widget.get_attribute("data-output") == "62951413"
    assert "8 of 8 right" in widget.locator(".revtrain-verdict").text_content()
    widget.locator("input.revtrain-input").fill("9x1")
    assert widget.locator("svg.revtrain-map").nth(1).locator("rect.revtrain-cell").count() == 4
    assert "trained on 8 digits only" in widget.locator(".revtrain-verdict").text_content()
    # Train again goes on for 150 more steps
    widget.get_by_role("button", name="Train").click()
    page.wait_for_function("sel => Number(document.querySelector(sel).dataset.step) > 150", arg=WIDGET)
    assert widget.locator(".revtrain-count").text_content().endswith("/ 300")
    assert not page.console_errors


def test_without_positions_the_loss_stays_high(page, site_url: str):
    """Page 6b's Exercise 4 sends the reader here: the widget shows the stall the page computes."""
    page.goto(site_url + PAGE)
    page.wait_for_function("() => window.attentionRefReverser !== undefined")
    losses = page.evaluate("() => window.attentionRefReverser.run({positions: false, steps: 150}).losses")
    end = sum(losses[-10:]) / 10
    print(f"no positions, mean of the last 10 losses: {end:.3f}")
    assert 1.5 < end < math.log(V)


def test_stop_stops_and_reset_resets(page, site_url: str):
    widget = open_widget(page, site_url)
    train, stop, reset = (widget.get_by_role("button", name=n) for n in ("Train", "Stop", "Reset"))
    assert stop.is_disabled()
    train.click()
    page.wait_for_function("sel => Number(document.querySelector(sel).dataset.step) >= 3", arg=WIDGET)
    assert train.is_disabled()
    stop.click()
    stopped = step_of(widget)
    assert widget.get_attribute("data-training") == "0" and 3 <= stopped < 150
    page.wait_for_timeout(700)
    assert step_of(widget) == stopped, "the step count grew after Stop"
    assert f"step {stopped} / 150" == widget.locator(".revtrain-count").text_content()
    assert stop.is_disabled() and train.is_enabled()
    train.click()
    page.wait_for_function("([sel, k]) => Number(document.querySelector(sel).dataset.step) > k",
                           arg=[WIDGET, stopped])
    stop.click()
    reset.click()
    assert step_of(widget) == 0 and widget.get_attribute("data-loss") == ""
    assert widget.locator("polyline.revtrain-curve").get_attribute("points") == ""
    assert widget.locator(".revtrain-count").text_content() == "step 0 / 150"
    page.wait_for_timeout(500)
    assert step_of(widget) == 0
    # a new architecture is a new model, at step 0
    train.click()
    page.wait_for_function("sel => Number(document.querySelector(sel).dataset.step) >= 2", arg=WIDGET)
    widget.locator("select[aria-label=Heads]").select_option("4")
    assert step_of(widget) == 0 and widget.get_attribute("data-training") == "0"
    assert "4 heads" in widget.locator(".revtrain-status").text_content()
    assert not page.console_errors


def test_keyboard_reaches_and_works_the_controls(page, site_url: str):
    widget = open_widget(page, site_url)
    widget.locator("select[aria-label='Learning rate']").focus()
    names = []
    for _ in range(7):
        names.append(page.evaluate("document.activeElement.getAttribute('aria-label') || document.activeElement.textContent"))
        page.keyboard.press("Tab")
    assert names == ["Learning rate", "Heads", "Learned positions", "Steps", "Seed", "Train", "Reset"], names
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Up to 8 digits for the model to reverse"
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Enter")  # Train
    page.wait_for_function("sel => Number(document.querySelector(sel).dataset.step) >= 2", arg=WIDGET)
    page.keyboard.press("Tab")  # Stop, enabled now
    assert page.evaluate("document.activeElement.textContent") == "Stop"
    page.keyboard.press("Enter")
    assert widget.get_attribute("data-training") == "0"
    widget.locator("input[aria-label='Learned positions']").focus()
    page.keyboard.press("Space")
    assert step_of(widget) == 0 and "positions off" in widget.locator(".revtrain-status").text_content()
    assert not page.console_errors


def test_fits_a_phone(page, site_url: str):
    page.set_viewport_size({"width": 390, "height": 800})
    widget = open_widget(page, site_url)
    widget.locator("input[aria-label=Steps]").fill("5")
    widget.locator("input[aria-label=Steps]").dispatch_event("change")
    widget.get_by_role("button", name="Train").click()
    page.wait_for_function("sel => document.querySelector(sel).dataset.step === '5'", arg=WIDGET)
    box = widget.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    for svg in widget.locator("svg").all():
        b = svg.bounding_box()
        assert b["x"] >= box["x"] and b["x"] + b["width"] <= box["x"] + box["width"] and b["width"] >= 250, b
    assert not page.console_errors


#: (what, text colour, background) of the widget's text, and its curve's colour, as the eye sees them
COLOURS = IN_SCHEME + """  const out = [];
  for (const node of widget.querySelectorAll('button:not(:disabled), select, input, label span, p, th, td, .revtrain-count')) {
    const style = getComputedStyle(node);
    let back = page;
    for (let n = node; n; n = n.parentElement) {
      const c = getComputedStyle(n).backgroundColor;
      if (!/rgba\\(.*, 0\\)$/.test(c) && c !== 'transparent') { back = over(c, page); break; }
    }
    out.push({ what: node.tagName + ' ' + (node.textContent || node.getAttribute('aria-label') || '').slice(0, 30),
               text: over(style.color, back), background: back });
  }
  for (const text of widget.querySelectorAll('svg text')) {
    out.push({ what: 'svg ' + text.textContent, text: over(getComputedStyle(text).fill, page), background: page });
  }
  const curve = getComputedStyle(widget.querySelector('.revtrain-curve')).stroke;
  return { texts: out, curve: over(curve, page), page };
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_text_and_curve_read_in_both_schemes(page, site_url: str, scheme: str):
    widget = open_widget(page, site_url)
    widget.get_by_role("button", name="Train").click()
    page.wait_for_function("sel => Number(document.querySelector(sel).dataset.step) >= 2", arg=WIDGET)
    widget.get_by_role("button", name="Stop").click()
    colours = widget.evaluate(COLOURS, scheme)
    assert len(colours["texts"]) > 30
    for item in colours["texts"]:
        assert _contrast(item["text"], item["background"]) >= 4.5, (scheme, item)
    assert _contrast(colours["curve"], colours["page"]) >= 3, (scheme, colours["curve"])
