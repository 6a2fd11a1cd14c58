"""BatchLLM's group scheduler: the batch is planned globally into prefix-sharing groups (flock.prefix), and a
group is the unit of admission. A group's shared prefix is prefilled once by a prefix-only pseudo-request
whose blocks stay pinned until the group's last member finishes; the members then start from those blocks.

Each step fills three queues in order, under a token budget, a KV-memory bound and `max_num_seqs` running
members: decode tokens; prefill chunks of members of groups whose prefix is done; prefix chunks of the next groups.
When decode growth runs out of blocks, the newest group gives way (recompute): its newest members first,
its pinned prefix only once none of its members runs; a group that alone exceeds the KV cache gives up its
own newest members and admits them again later, and a lone member that cannot grow beside its group's pinned
prefix unpins it (the group runs on without one).
"""

from collections import deque
from dataclasses import dataclass, field

from flock.kv.manager import CachedPrefix
from flock.prefix import plan_prefixes
from flock.request import Request, RequestStatus
from flock.sampling_params import SamplingParams
from flock.sched.base import Scheduler, StepPlan


@dataclass
class GroupState:
    prefix_len: int  # shared tokens (whole blocks only without prefix caching, which copies a partial block's)
    waiting: deque[Request]  # members not admitted (or preempted)
    admitted: list[Request] = field(default_factory=list)
    prefix: Request | None = None  # pseudo-request pinning the shared blocks while the group is active
    unfinished: int = 0

    @property
    def prefix_done(self) -> bool:
        return self.prefix is None or self.prefix.num_computed_tokens == self.prefix.num_tokens


class BatchLLMScheduler(Scheduler):
    name = "batchllm"
    kv_bound = 0.9  # M_threshold: new prefill chunks keep KV use under this fraction of the pool

    def __init__(self, config, kv):
        super().__init__(config, kv)
        self.unplanned: list[Request] = []
        self.pending: deque[GroupState] = deque()
        self.active: list[GroupState] = []
        self.group_of: dict[int, GroupState] = {}
        self._pseudo_ids = 0
        self._room = 0  # members the step may still admit (max_num_seqs less those running)

    def add(self, req: Request) -> None:
        self.unplanned.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.unplanned or self.pending or self.active)

    @property
    def num_waiting(self) -> int:
        """Members not admitted: unplanned, in pending groups, and waiting (or preempted) in active ones."""
        return len(self.unplanned) + sum(len(g.waiting) for g in (*self.pending, *self.active))

    # -- planning ----------------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Groups of the unplanned requests, planned apart for each cache salt and LoRA adapter: requests of
        different ones never share blocks."""
        by_namespace: dict[tuple, list[Request]] = {}
        for r in self.unplanned:
            by_namespace.setdefault(r.cache_namespace, []).append(r)
        groups = [group for requests in by_namespace.values() for group in self._groups(requests)]
        groups.sort(key=lambda x: x[0])  # R_group = 1 / (L_prefix + sum L_distinct), largest first
        self.pending.extend(g for _, g in groups)
        self.unplanned = []

    def _groups(self, requests: list[Request]) -> list[tuple[int, GroupState]]:
        """The planned groups, and a group of its own for each request that reads no cached prefix (prompt
        logprobs: it computes its whole prompt, so a pinned group prefix could only crowd it out)."""
        alone = [r for r in requests if not r.reads_prefix_cache]
        groups = [(r.num_prompt_tokens, self._group([r], 0)) for r in alone]
        requests = [r for r in requests if r.reads_prefix_cache]
        plan = plan_prefixes([r.cache_ids(0, r.num_prompt_tokens) for r in requests])
        for g in plan.groups:
            members = [requests[i] for i in g.indices]
            # every member keeps at least one token of its own to compute; members take a prefix that ends
            # inside a block from the prefix cache, which copies that block's start (without it: whole blocks)
            shortest = min(m.num_prompt_tokens for m in members)
            shared = self._prefix_end(members[0], min(g.prefix_len, shortest - 1) if len(members) > 1 else 0)
            groups.append((g.computed_tokens, self._group(members, shared)))
        return groups

    def _group(self, members: list[Request], prefix_len: int) -> GroupState:
        group = GroupState(prefix_len, deque(members), unfinished=len(members))
        for m in members:
            self.group_of[m.request_id] = group
        return group

    def _prefix_end(self, first: Request, length: int) -> int:
        """A group prefix of at most `length` tokens: whole blocks without prefix caching, and never ending inside
        an image whose tokens attend both ways (its pseudo-request would compute part of it)."""
        images = first.params.multi_modal
        while True:
            end = length if self.kv.enable_prefix_caching else length // self.kv.block_size * self.kv.block_size
            if images is not None and images.spans is not None:
                end = images.prefix_end(end)
            if end == length:
                return end
            length = end

    # -- the step ----------------------------------------------------------------------------------------------
    def _schedule(self) -> StepPlan:
        if self.unplanned:
            self._plan()
        plan = self._fill()
        if not plan and self.active:
            # pinned prefixes left no room for any member: only now give up the newest idle group's prefix
            idle = [g for g in self.active if not g.admitted]
            if idle:
                self._preempt_group(idle[-1], plan)
                retry = self._fill()
                plan.scheduled, plan.preempted = retry.scheduled, plan.preempted + retry.preempted
        return plan

    def _fill(self) -> StepPlan:
        plan = StepPlan()
        self._room = self.config.max_num_seqs - sum(len(g.admitted) for g in self.active)
        # a prefill under way (a member's, or a started group prefix's) that cannot take its next chunk blocks
        # admissions until it can: new requests never starve it of KV (as vLLM runs its running requests first)
        self._blocked = False
        budget = self._decode(plan, self.config.max_num_batched_tokens)
        started = [g for g in self.active if not g.prefix_done and self.kv.num_blocks(g.prefix)]
        for g in list(self.active):
            if g.prefix_done:
                budget = self._continue(g, plan, budget)
        for g in started:
            budget = self._prefix(g, plan, budget)
        for g in list(self.active):
            if g.prefix_done and not self._blocked:
                budget = self._admit(g, plan, budget)
        for g in self.active:
            if not g.prefix_done and g not in started and not self._blocked:
                budget = self._prefix(g, plan, budget)
        # next groups start while the budget lasts and their prefix chunks keep KV use under the bound; if
        # pinned prefixes ever leave no room for any member, `schedule` gives the newest idle one up
        while budget > 0 and self._room > 0 and self.pending and not self._blocked:
            if not plan.scheduled and any(g.waiting for g in self.active):
                break
            g = self.pending.popleft()
            self.active.append(g)
            if g.prefix_len:
                g.prefix = self._pseudo_request(g)
            budget = self._admit(g, plan, budget) if g.prefix_done else self._prefix(g, plan, budget)
            if not g.admitted and (g.prefix is None or not self.kv.num_blocks(g.prefix)):
                self.active.pop()  # nothing fitted: try again next step
                self.pending.appendleft(g)
                g.prefix = None
                break
        return plan

    def _decode(self, plan: StepPlan, budget: int) -> int:
        for g in list(self.active):
            for req in list(g.admitted):
                if budget == 0 or req.num_tokens - req.num_computed_tokens != 1 or req not in g.admitted:
                    continue
                n = self.with_drafts(req, 1, budget)
                while not self.allocate(req, n):
                    if not self._make_room(g, req, plan):
                        break
                if req in g.admitted:
                    plan.scheduled.append((req, n))
                    budget -= n
        return budget

    def _continue(self, g: GroupState, plan: StepPlan, budget: int) -> int:
        """The group's unfinished prefills (chunked, or recomputing after preemption)."""
        scheduled = {r.request_id for r, _ in plan.scheduled}
        for req in g.admitted:
            n = req.chunk(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if req.request_id in scheduled or n <= 1 and req.num_output_tokens or n == 0:
                continue
            needed = self.kv.blocks_needed(req.num_computed_tokens + n) - self.kv.num_blocks(req)
            if not self._fits(plan, needed) or not self.allocate(req, n):
                self._blocked = True
                return budget
            plan.scheduled.append((req, n))
            budget -= n
        return budget

    def _admit(self, g: GroupState, plan: StepPlan, budget: int) -> int:
        """The group's waiting members, while they fit."""
        while g.waiting and budget > 0 and self._room > 0:
            req = g.waiting[0]
            cached = self._shared_blocks(g, req)
            start = self.kv.prefix_tokens(cached)
            n = req.chunk(start, min(req.num_tokens - start, budget))
            needed = self.kv.blocks_needed(start + n) - len(cached)
            if not self._fits(plan, needed) or not self.allocate(req, n, cached):
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = self.kv.prefix_tokens(cached)
            g.waiting.popleft()
            g.admitted.append(req)
            self._room -= 1
            req.status = RequestStatus.RUNNING
            plan.scheduled.append((req, n))
            budget -= n
        return budget

    def _prefix(self, g: GroupState, plan: StepPlan, budget: int) -> int:
        p = g.prefix
        held = self.kv.num_blocks(p)
        cached = self.kv.cached_prefix(p) if not held else CachedPrefix()  # sharing above this group's level
        computed = p.num_computed_tokens + self.kv.prefix_tokens(cached)
        n = p.chunk(computed, min(p.num_tokens - computed, budget))
        needed = self.kv.blocks_needed(computed + n) - held - len(cached)
        if n > 0 and self._fits(plan, needed) and self.allocate(p, n, cached):
            plan.scheduled.append((p, n))
            budget -= n
        elif n > 0 and held:
            self._blocked = True
        return budget

    def _shared_blocks(self, g: GroupState, req: Request) -> CachedPrefix:
        if self.kv.enable_prefix_caching or not req.reads_prefix_cache:  # the group prefix, any sharing deeper
            return self.kv.cached_prefix(req)
        return CachedPrefix([] if g.prefix is None else self.kv.block_table(g.prefix)[: g.prefix_len // self.kv.block_size])

    def _fits(self, plan: StepPlan, blocks: int) -> bool:
        """The KV bound, waived when the step is still empty (so a huge group can always make progress)."""
        if blocks > self.kv.pool.num_free:
            return False
        return not plan.scheduled or self.kv.pool.num_used + blocks <= self.kv_bound * self.kv.pool.num_blocks

    def _pseudo_request(self, g: GroupState) -> Request:
        self._pseudo_ids -= 1
        first = g.waiting[0]
        p = Request(self._pseudo_ids, first.prompt_token_ids[: g.prefix_len],
                    SamplingParams(max_tokens=1, cache_salt=first.params.cache_salt,
                                   lora_request=first.params.lora_request, multi_modal=first.params.multi_modal),
                    prefix_only=True, adapter_id=first.adapter_id)
        p.status = RequestStatus.RUNNING
        return p

    # -- preemption and finishing ------------------------------------------------------------------------------
    def _make_room(self, g: GroupState, keep: Request, plan: StepPlan) -> bool:
        """Free blocks for `keep` (of group g), newest first: the members of newer groups (nothing of theirs
        is scheduled yet: decode runs oldest group first), then g's own newest members not scheduled in this
        step (`keep` itself last). Pinned prefixes stay. False when `keep` itself was preempted."""
        for newer in reversed(self.active[self.active.index(g) + 1 :]):
            if newer.admitted:
                self._preempt_member(newer, newer.admitted[-1], plan)
                return True
        scheduled = {r.request_id for r, _ in plan.scheduled}
        victims = [m for m in g.admitted if m.request_id not in scheduled]
        victim = next((m for m in reversed(victims) if m is not keep), keep)
        if victim is keep and g.prefix is not None and g.admitted == [keep]:
            self._unpin(g, plan)
            return True
        self._preempt_member(g, victim, plan)
        return victim is not keep

    def _unpin(self, g: GroupState, plan: StepPlan) -> None:
        """The group runs on without its pinned prefix: the blocks its members share stay theirs; what the prefix
        held alone (a tail inside a block) is freed, and it is never pinned again (re-pinned, the same member
        would meet the same wall)."""
        plan.preempted.append(g.prefix)
        self.kv.free(g.prefix)
        g.prefix, g.prefix_len = None, 0

    def _preempt_member(self, g: GroupState, req: Request, plan: StepPlan) -> None:
        plan.preempted.append(req)
        self.release(req)
        g.admitted.remove(req)
        g.waiting.appendleft(req)

    def _preempt_group(self, g: GroupState, plan: StepPlan) -> None:
        for req in reversed(list(g.admitted)):
            self._preempt_member(g, req, plan)
        if g.prefix is not None:
            plan.preempted.append(g.prefix)
            self.kv.free(g.prefix)
            g.prefix = None
        self.active.remove(g)
        self.pending.appendleft(g)

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        g = self.group_of.pop(req.request_id)
        g.admitted.remove(req)
        self.kv.free(req)
        self._member_done(g)

    def abort(self, req: Request) -> None:
        g = self.group_of.pop(req.request_id, None)
        if g is None:  # not planned yet
            self.unplanned.remove(req)
        elif req in g.admitted:
            g.admitted.remove(req)
        else:
            g.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        if g is not None:
            self._member_done(g)

    def _member_done(self, g: GroupState) -> None:
        g.unfinished -= 1
        if g.unfinished:
            return
        if g.prefix is not None:  # the pinned prefix goes the moment the last member is done
            self.kv.free(g.prefix)
        if g in self.active:
            self.active.remove(g)
        elif g in self.pending:
            self.pending.remove(g)
