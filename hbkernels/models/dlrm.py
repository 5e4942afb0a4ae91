"""DLRM (Naumov et al., 2019): a CTR model whose sparse part is an
:class:`hbkernels.EmbeddingCollection` and whose dense part is PyTorch.

    z0 = bottom_mlp(dense)                       # [B, D]   (no dense features: absent)
    e_f = collection(sparse)[f]                  # [B, D]   one pooled vector per feature
    x = [z0, e_1, ..., e_F]                      # n vectors of width D
    p = (x_i . x_j  for i > j)                   # n(n-1)/2 pairwise dots ("dot interaction")
    logit = top_mlp([z0, p])                     # [B]

The MLPs are ``Linear`` + ReLU (the bottom MLP ends in ReLU, the top MLP in a
bare ``Linear`` to one logit). The embeddings train with the collection's own
sparse optimizer when ``loss.backward()`` runs (see
:class:`hbkernels.adapters.torch.EmbeddingCollectionModule`); ``parameters()``
are the dense ones only, for a torch optimizer.

>>> import numpy as np, torch, hbkernels as hbk
>>> from hbkernels.adapters.torch import EmbeddingCollectionModule
>>> coll = hbk.EmbeddingCollection(
...     [hbk.TableSpec("user", num_rows=100, dim=8), hbk.TableSpec("item", num_rows=50, dim=8)],
...     comm=hbk.dist.init("local"), optimizer=hbk.optim.Adagrad(lr=0.1), seed=0)
>>> _ = torch.manual_seed(0)
>>> model = DLRM(EmbeddingCollectionModule(coll), ["user", "item"], num_dense=4, dim=8)
>>> logits = model(torch.randn(3, 4), {"user": torch.tensor([1, 2, 99]), "item": torch.tensor([0, 0, 49])})
>>> logits.shape
torch.Size([3])
"""
import torch


def mlp(sizes, final_relu):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if final_relu or i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class _Gram(torch.autograd.Function):
    """``x @ x^T`` per sample (``x`` ``[B, n, D]``) whose backward is one batched
    matmul, ``(G + G^T) @ x``, where autograd would run two."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.bmm(x, x.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.bmm(grad + grad.transpose(1, 2), x)


class DLRM(torch.nn.Module):
    """``DLRM(embeddings, features, num_dense, dim, bottom=(64,), top=(64, 32))``;
    ``forward(dense [B, num_dense], sparse {feature: ids}) -> logits [B]``."""

    def __init__(self, embeddings, features, num_dense, dim, bottom=(64,), top=(64, 32)):
        super().__init__()
        self.embeddings = embeddings
        self.features = list(features)
        self.num_dense = int(num_dense)
        vectors = len(self.features) + (1 if self.num_dense else 0)
        if vectors < 2:
            raise ValueError("DLRM needs at least two vectors to interact: "
                             "two sparse features, or one and dense features")
        self.bottom = mlp([self.num_dense, *bottom, dim], final_relu=True) if self.num_dense else None
        pairs = vectors * (vectors - 1) // 2
        self.top = mlp([pairs + (dim if self.num_dense else 0), *top, 1], final_relu=False)
        rows, cols = torch.tril_indices(vectors, vectors, offset=-1)
        # pair (i, j) at i * n + j of the flattened [n, n] dots: one index_select, whose
        # backward is one index_add (advanced indexing's is a slower index_put)
        self.register_buffer("pairs", rows * vectors + cols, persistent=False)

    def forward(self, dense, sparse):
        pooled = self.embeddings(sparse)
        vectors = [pooled[f] for f in self.features]
        if self.bottom is not None:
            z0 = self.bottom(dense)
            vectors.insert(0, z0)
        x = torch.stack(vectors, dim=1)                       # [B, n, D]
        dots = _Gram.apply(x)                                 # [B, n, n]
        pairs = dots.flatten(1).index_select(1, self.pairs)  # [B, n(n-1)/2]
        top_in = torch.cat([z0, pairs], dim=1) if self.bottom is not None else pairs
        return self.top(top_in).squeeze(1)
