"""The channel between trainer rank 0 and the engine ranks: a gloo group of their own
(channel rank 0 is trainer rank 0, channel rank ``1 + i`` engine rank ``i``), carrying
pickled messages and buckets of tensors, each bucket as one flat buffer. On CUDA the
buckets go over an NCCL group of the same members instead (GPU to GPU, as verl's and
OpenRLHF's weight broadcasts do), the messages still over gloo."""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from lightrft.strategy import distributed

_TAG = 0  # one tag: a pair's messages arrive in the order they were sent


class Channel:
    """Point-to-point messages over a gloo process group made only by its members.

    Args:
        rank: this process's channel rank (0: trainer rank 0; 1, 2, ...: engine ranks).
        size: 1 + the number of engine ranks.
        timeout: how long a receive waits for its sender.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        device: torch.device | None = None,
    ) -> None:
        store = distributed.group_store("engine-channel/")
        nccl_store = distributed.group_store("engine-channel-nccl/")
        if store is None or nccl_store is None:
            raise RuntimeError("the engine channel needs the job's process group first")
        self.rank, self.size, self.timeout = rank, size, timeout
        self._group: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
        #: Where buckets travel: this process's CUDA device over NCCL, else host memory
        #: over gloo (``transport``).
        self.device, self.transport = torch.device("cpu"), "gloo"
        self._tensors: Any = self._group
        if device is not None and device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._tensors = dist.ProcessGroupNCCL(nccl_store, rank, size, options)
            self.device, self.transport = device, "nccl"

    def send(self, message: Any, to: int, wait: bool = True) -> list[Any]:
        """Send a picklable ``message`` to channel rank ``to``. With ``wait=False`` the
        send is left in flight (the receiver may not be reading yet): the returned works
        hold its buffers; wait on them before relying on its arrival."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        works = [
            self._group.send([torch.tensor([data.numel()], dtype=torch.int64)], to, _TAG),
            self._group.send([data], to, _TAG),
        ]
        if wait:
            for work in works:
                work.wait()
        return [(work, data) for work in works]

    def receive(self, sender: int) -> Any:
        """The next message from channel rank ``sender`` (waits up to the timeout)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._receive(size, sender)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._receive(data, sender)
        return pickle.loads(data.numpy().tobytes())

    @staticmethod
    def layout(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
        """The (shape, dtype) of each tensor: what :meth:`receive_tensors` needs."""
        return [(tuple(t.shape), t.dtype) for t in tensors]

    def send_tensors(self, tensors: list[torch.Tensor], to: int) -> None:
        """Send ``tensors`` to ``to`` as one flat buffer (their :meth:`layout` goes
        first, in a message)."""
        flat = [
            t.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8) for t in tensors
        ]
        if flat:
            self._tensors.send([torch.cat(flat)], to, _TAG).wait()

    def receive_tensors(self, layout: list[tuple[Any, ...]], sender: int) -> list[torch.Tensor]:
        """The tensors of one :meth:`send_tensors` from ``sender``, given their layout."""
        sizes = [
            int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in layout
        ]
        if not layout:
            return []
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        self._tensors.recv([buffer], sender, _TAG).wait()
        out, start = [], 0
        for (shape, dtype), nbytes in zip(layout, sizes, strict=True):
            out.append(buffer[start : start + nbytes].view(dtype).reshape(shape))
            start += nbytes
        return out

    def _receive(self, tensor: torch.Tensor, sender: int) -> None:
        self._group.recv([tensor], sender, _TAG).wait()
