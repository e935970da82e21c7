"""core.capabilities: an executor's optional abilities, read once from the protocols it implements."""

from __future__ import annotations

from tokenloop.core.capabilities import NO_LORA, Capabilities
from tokenloop.core.kv_events import KvEventHub
from tokenloop.looper.faults import FaultyExecutor


class Plain:
    """Only the Executor protocol."""

    def enqueue(self, request):
        return 0

    def await_responses(self, timeout):
        return []

    def cancel(self, request_id):
        pass

    def stats(self):
        return None

    def shutdown(self):
        pass


class Able(Plain):
    dtype = "bfloat16"

    def __init__(self, lora_enabled=True):
        self.kv_events = KvEventHub()
        self.loras = object()
        self.lora_enabled = lora_enabled
        self.lora_disabled_reason = "" if lora_enabled else "started without --lora"
        self.woken = 0

    def wake(self):
        self.woken += 1

    def pause(self, request_id):
        pass

    def resume(self, request_id):
        pass

    def set_death_callback(self, callback):
        pass

    def read_lora(self, name, path):
        pass

    def add_lora(self, adapter):
        pass

    def unload_lora(self, name):
        pass


def test_an_executor_with_no_optional_ability_declares_none():
    caps = Capabilities.of(Plain())
    assert caps == Capabilities()
    assert (caps.wake, caps.pause, caps.death_callback, caps.lora, caps.kv_events, caps.dtype) == \
        (None, False, None, False, None, None)
    assert caps.lora_disabled_reason == NO_LORA


def test_every_ability_is_found_once_and_bound_to_the_executor():
    executor = Able()
    caps = Capabilities.of(executor)
    assert caps.pause and caps.lora and caps.kv_events is executor.kv_events and caps.dtype == "bfloat16"
    assert caps.death_callback == executor.set_death_callback
    caps.wake()
    assert executor.woken == 1


def test_lora_methods_without_lora_enabled_refuse_with_the_executors_reason():
    caps = Capabilities.of(Able(lora_enabled=False))
    assert not caps.lora and caps.lora_disabled_reason == "started without --lora"


def test_pause_needs_resume_too():
    class HalfPause(Plain):
        def pause(self, request_id):
            pass

    assert not Capabilities.of(HalfPause()).pause


def test_a_method_set_to_none_is_no_ability():
    executor = Able()
    executor.wake = None
    assert Capabilities.of(executor).wake is None


def test_the_fault_wrapper_keeps_the_abilities_of_what_it_wraps():
    inner = Able()
    caps = Capabilities.of(FaultyExecutor(inner, die_after_polls=3))
    assert caps.pause and caps.lora and caps.kv_events is inner.kv_events
    caps.wake()
    assert inner.woken == 1
