import torch

from flock.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of logits. Greedy rows take the argmax; sampled rows apply temperature,
    top-k and top-p, then draw with the request's own generator, so a seeded request gives the same
    tokens whatever batch it runs in."""

    def __init__(self, seed: int):
        self.default_generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        return tokens

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        if min(top_k) < vocab:
            k = torch.tensor(top_k, device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        if (top_p < 1).any():
            logits = _apply_top_p(logits, top_p)
        probs = logits.softmax(dim=-1).cpu()
        out = []
        for row, gen in zip(probs, generators):
            noise = torch.empty_like(row).exponential_(generator=gen or self.default_generator)
            out.append(int((row / noise).argmax()))  # exponential race == multinomial draw
        return torch.tensor(out, device=logits.device)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
