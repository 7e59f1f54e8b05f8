"""learners.thread_dial: a thread count set from any thread takes effect at the next layer of the
running forward or backward, in the thread that runs it; the numbers are the same."""

import threading

import pytest
import torch

from learners.thread_dial import ThreadDial


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_and_probe(dial: ThreadDial, turn_at: int, to: int, back_turn_at: int = -1, back_to: int = 1):
    """Four linear layers. A signal from another thread sets ``to`` after layer ``turn_at``'s
    forward, and ``back_to`` after layer ``back_turn_at``'s gradient; torch's count is recorded
    in each layer's forward and when the backward reaches it."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    dial.attach(layers)
    seen = {"forward": [], "backward": []}

    def signal(threads):  # from another thread, as Ray's concurrency group delivers set_threads
        t = threading.Thread(target=dial.set, args=(threads,))
        t.start()
        t.join()

    def backward_hook(grad, i):
        seen["backward"].append((i, torch.get_num_threads()))
        if i == back_turn_at:
            signal(back_to)

    for i, layer in enumerate(layers):
        def forward_hook(module, args, output, i=i):
            seen["forward"].append(torch.get_num_threads())
            if i == turn_at:
                signal(to)
            if output.requires_grad:
                output.register_hook(lambda grad, i=i: backward_hook(grad, i))
        layer.register_forward_hook(forward_hook)
    return layers, seen


def test_a_count_set_from_another_thread_is_taken_at_the_next_layer(one_thread):
    dial = ThreadDial(1)
    layers, seen = model_and_probe(dial, turn_at=0, to=2, back_turn_at=2, back_to=1)
    out = layers(torch.randn(3, 8)).sum()
    assert seen["forward"] == [1, 2, 2, 2]  # layer 0 ran on one thread; from layer 1 on, two
    assert torch.get_num_threads() == 2
    out.backward()
    # the backward reaches the last layer first; the count set after layer 2's gradient is
    # taken before layer 1's
    assert seen["backward"] == [(3, 2), (2, 2), (1, 1), (0, 1)]
    assert dial.turns == 2 and dial.applied == 1 and torch.get_num_threads() == 1


def test_a_count_set_between_updates_is_taken_at_the_first_layer(one_thread):
    dial = ThreadDial(1)
    layers, seen = model_and_probe(dial, turn_at=-1, to=1)
    dial.set(2)
    assert torch.get_num_threads() == 1  # nothing changes outside the model's layers
    layers(torch.randn(3, 8)).sum().backward()
    assert seen["forward"] == [2, 2, 2, 2] and [n for _, n in seen["backward"]] == [2, 2, 2, 2]
    assert dial.turns == 1


def test_no_gradient_no_backward_hook(one_thread):
    dial = ThreadDial(1)
    layers, _ = model_and_probe(dial, turn_at=0, to=2)
    with torch.no_grad():
        layers(torch.randn(2, 8))
    assert dial.applied == 2 and torch.get_num_threads() == 2
