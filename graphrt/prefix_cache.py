"""KV blocks of earlier prompts, found again by their tokens (Runtime(prefix_caching=True)).

A request's prompt fills whole KV blocks before its decode writes begin; a later request whose
prompt starts with the same tokens can read those blocks instead of prefilling them. Each whole
block a prefill wrote is keyed by the tokens of its prompt up to its end, and with an EAGLE head
(next_token) up to and including the first token after it: the head's KV row at position j pairs
the target's state at j with token j + 1, so a block's KV depends on the token that follows it.
Either way a cached block ends before the prompt's last token. A block is shared only while no request
writes it: every write lands at or past a request's prompt length (decode, rejected drafts, prefill
padding).

Blocks no request holds stay cached (idle, least recently released first) until an allocation
needs them, so the pool's free count includes them.
"""

from __future__ import annotations

from collections import OrderedDict

from graphrt.kv_cache import BlockAllocator


class PrefixCache:
    """Block ownership over a BlockAllocator: blocks held by requests (counted), and whole prompt
    blocks kept for reuse."""

    def __init__(self, allocator: BlockAllocator, block_size: int, next_token: bool = True):
        """next_token: a block's KV depends on the token after it too (a draft that reads the
        target's hidden states: EAGLE heads), which its key then holds."""
        self.allocator, self.block_size, self.next_token = allocator, block_size, next_token
        self._block_of: dict[tuple, int] = {}  # key -> block
        self._key_of: dict[int, tuple] = {}  # block -> key
        self._holders: dict[int, int] = {}  # block -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, oldest first

    @property
    def num_free(self) -> int:
        return self.allocator.num_free + len(self._idle)

    def keys(self, prompt: list[int]) -> list[tuple]:
        """The key of each whole block of prompt that a token follows, in order (what match and
        remember take): (the hash of the block before's key, this block's tokens and, with
        next_token, the next one), so that a key costs its own tokens."""
        bs, parent, keys, extra = self.block_size, 0, [], int(self.next_token)
        for i in range((len(prompt) - 1) // bs):
            key = (parent, tuple(prompt[i * bs:(i + 1) * bs + extra]))
            parent = hash(key)
            keys.append(key)
        return keys

    def match(self, keys: list[tuple]) -> list[int]:
        """The cached blocks holding the longest run of a prompt's first whole blocks, by their
        keys (the last prompt token never among them: its row gives the first token's logits)."""
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def free_after_taking(self, blocks: list[int]) -> int:
        """num_free once `blocks` (a match) are held."""
        return self.num_free - sum(b in self._idle for b in blocks)

    def take(self, matched: list[int], n: int) -> list[int]:
        """Hold the matched blocks and n new ones (evicting the longest-idle cached blocks when the
        free list runs short); returns matched + the new blocks."""
        for b in matched:
            self._idle.pop(b, None)
            self._holders[b] = self._holders.get(b, 0) + 1
        short = n - self.allocator.num_free
        if short > 0:
            evicted = [self._idle.popitem(last=False)[0] for _ in range(short)]
            for b in evicted:
                del self._block_of[self._key_of.pop(b)]
            self.allocator.free(evicted)
        new = self.allocator.allocate(n)
        self._holders.update(dict.fromkeys(new, 1))
        return matched + new

    def remember(self, keys: list[tuple], blocks: list[int]) -> None:
        """Key a prompt's whole blocks by their keys (the first block for a key stays the one
        found) once the prefill that writes the prompt's KV into blocks is on the stream: whatever
        reads them later, a request prefilled in the same forward included, runs after it. If that
        prefill fails, forget the blocks."""
        for key, b in zip(keys, blocks):
            if key not in self._block_of and b not in self._key_of:
                self._block_of[key], self._key_of[b] = b, key

    def forget(self, blocks: list[int]) -> None:
        """Unkey blocks whose KV was never written (their prefill failed)."""
        for b in blocks:
            key = self._key_of.pop(b, None)
            if key is not None:
                del self._block_of[key]

    def release(self, blocks: list[int]) -> None:
        """A request gives its blocks back: cached ones idle once no request holds them, the rest
        return to the free list."""
        uncached = []
        for b in blocks:
            self._holders[b] -= 1
            if self._holders[b]:
                continue
            del self._holders[b]
            if b in self._key_of:
                self._idle[b] = None
            else:
                uncached.append(b)
        self.allocator.free(uncached)
