"""`ElasticSampler`: a sampler whose epoch survives changes of the
cluster and of the batch size (every sample of an epoch seen exactly once
by the cluster)."""

import torch

import kungfu


class ElasticSampler:
    """A sampler for elastic training, with the semantics of horovod's
    `horovod.torch.elastic.ElasticSampler`: within an epoch, across changes
    of the batch size and of the cluster, every sample of `dataset` is seen
    exactly once by the cluster.

    The epoch's order is a permutation of the dataset's indices that
    depends only on `seed` and the epoch (`shuffle=False`: in order), so
    every worker knows it without communicating. What the cluster has
    processed is a set of indices (`record_batch`, `record_indices`,
    `advance`; `processed_num` counts them), part
    of `state_dict()` (which `PolicyRunner` syncs to workers that join).
    The rest is split between the workers of the cluster now:

    * `get_indices(batch_idx, batch_size)` is this worker's part of the
      `batch_idx`-th global batch of `batch_size` samples per worker taken
      from what remains: the global batch is the next
      `batch_size * size` remaining indices, and worker `r` has every
      `size`-th from the `r`-th. A remainder too small for every worker to
      have a sample is folded into the batch before it, so that no worker
      is ever handed an empty batch (the last batch of an epoch may hold
      up to `size - 1` more samples than the others).
    * iterating yields this worker's share of all that remains (every
      `size`-th index), as horovod's does, but without padding: the
      workers' shares differ in length by at most one.

    Call `reset()` after the cluster changed (the runner does), and
    `set_epoch(e)` at the start of each epoch (it forgets what was
    processed).
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def _order(self):
        n = len(self.dataset)
        key = (n, self.shuffle, self.seed, self.epoch)
        if getattr(self, "_order_key", None) != key:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                self._order_list = torch.randperm(n, generator=g).tolist()
            else:
                self._order_list = list(range(n))
            self._order_key = key
        return self._order_list

    def reset(self):
        """Takes the cluster as it is now (rank and size) and recomputes
        what remains of the epoch."""
        self.rank = kungfu.rank() if kungfu.is_initialized() else 0
        self.num_replicas = kungfu.size() if kungfu.is_initialized() else 1
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise RuntimeError(f"kungfu: ElasticSampler: rank {self.rank} of "
                               f"{self.num_replicas} (is the library initialized?)")
        done = self.processed_indices
        self.remaining_indices = [i for i in self._order() if i not in done]
        self.indices = self.remaining_indices[self.rank::self.num_replicas]
        self.num_samples = len(self.indices)
        self._cursor = 0

    def set_epoch(self, epoch):
        """Starts epoch `epoch`: a new order, nothing processed."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def _bounds(self, batch_idx, batch_size, first=0):
        """[start, end) in `remaining_indices` of the `batch_idx`-th global
        batch from position `first` (empty past the end)."""
        if batch_size < 1:
            raise ValueError(f"kungfu: a batch size of {batch_size}: at least 1")
        if batch_idx < 0:
            raise ValueError(f"kungfu: batch index {batch_idx}: at least 0")
        total, step = len(self.remaining_indices), batch_size * self.num_replicas
        start = min(first + batch_idx * step, total)
        end = min(start + step, total)
        if 0 < total - end < self.num_replicas:
            end = total  # a remainder some worker would have none of
        if start > 0 and start < total and total - start < self.num_replicas:
            start = end  # folded into the batch before
        return start, end

    def global_batch(self, batch_idx, batch_size):
        """Every worker's indices of the `batch_idx`-th global batch."""
        start, end = self._bounds(batch_idx, batch_size)
        return self.remaining_indices[start:end]

    def get_indices(self, batch_idx, batch_size):
        """This worker's indices of the `batch_idx`-th global batch
        (empty once the epoch is done)."""
        return self.global_batch(batch_idx, batch_size)[self.rank::self.num_replicas]

    def num_batches(self, batch_size):
        """How many global batches of `batch_size` per worker remain."""
        n = 0
        while self._bounds(n, batch_size)[0] < len(self.remaining_indices):
            n += 1
        return n

    def next_batch(self, batch_size):
        """The next global batch (every worker's indices) after the ones
        `advance` moved past since the last `reset`; empty at the end."""
        start, end = self._bounds(0, batch_size, self._cursor)
        return self.remaining_indices[start:end]

    def advance(self, batch):
        """Marks `batch` (what `next_batch` gave) processed and moves past
        it, without recomputing what remains (`reset` does)."""
        self.processed_indices.update(batch)
        self._cursor += len(batch)

    @property
    def processed_num(self):
        """How many samples of this epoch the cluster processed."""
        return len(self.processed_indices)

    def record_batch(self, batch_idx, batch_size):
        """Marks the cluster's next batch processed, as Horovod's does: the
        next `batch_size * size` samples of the epoch's order that are not
        processed yet (what a loader over this sampler gave the workers, in
        order, since the last `reset`). `batch_idx` is Horovod's argument,
        not used: after a `restore` the count goes on from the commit."""
        if batch_size < 1:
            raise ValueError(f"kungfu: a batch size of {batch_size}: at least 1")
        n = batch_size * self.num_replicas
        done = self.processed_indices
        self.record_indices([i for i in self._order() if i not in done][:n])

    def record_indices(self, indices):
        """Marks `indices` processed. Takes effect at the next `reset`."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.processed_indices = set(int(i) for i in state["processed_indices"])
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
