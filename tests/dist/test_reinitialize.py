"""A model trained by one engine, then given to a new engine (another stage, another
Trainer): the new engine trains it exactly like a fresh model holding the same weights.
The first engine is either destroyed before, or still open: then the new ``initialize``
closes it with a warning (its hooks would take the new engine's gradients) and the old
engine refuses further training by name."""
import reference as R


def _train(engine, rank, start, steps=2):
    for step in range(start, start + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()


def _full(model):
    import zerotrain
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _reinitialize(rank, world):
    import warnings
    import zerotrain
    from zerotrain.errors import StateError
    out = {}
    for first, second, take_over in ((2, 2, True), (3, 3, True), (3, 2, False), (1, 3, False)):
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=first))
        _train(engine, rank, 0)
        middle = _full(model)
        if not take_over:
            engine.destroy()
            engine.destroy()   # a second call does nothing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=second))
        out[(first, second, take_over, "warned")] = [str(w.message) for w in caught if "takes the model over"
                                  in str(w.message)]
        try:
            engine(*R.micro_batch(0, rank, 0))
            out[(first, second, take_over, "old engine")] = None
        except StateError as exc:
            out[(first, second, take_over, "old engine")] = str(exc)
        _train(again, rank, 2)
        got = _full(model)
        again.destroy()
        fresh_model = R.make_model()
        fresh_model.load_state_dict(middle)
        fresh, *_ = zerotrain.initialize(model=fresh_model,
                                         config=R.engine_config(stage=second))
        _train(fresh, rank, 2)
        out[(first, second, take_over, "trained")] = R.max_diff(got, _full(fresh_model))
        fresh.destroy()
    return out


def test_a_model_goes_to_a_new_engine_after_destroy_or_by_take_over(worlds):
    for rank, res in enumerate(worlds.run(2, _reinitialize)):
        for (first, second, take_over, what), value in res.items():
            if what == "warned":   # a take-over warns once, on rank 0
                assert len(value) == int(take_over and rank == 0), (first, second, value)
            elif what == "old engine":
                assert value is not None and "closed engine" in value, (first, value)
            else:
                assert value == 0.0, (first, second, take_over, value)


def _two_trainers(rank, world, root, stage):
    import torch
    import transformers
    from zerotrain.integrations.transformers import (ZeroTrainer, ZeroTrainingArguments,
                                                     zero3_init)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2)

    def args(name):
        return ZeroTrainingArguments(
            output_dir=f"{root}/{name}", per_device_train_batch_size=4, max_steps=2,
            learning_rate=1e-2, logging_steps=1, report_to=[], disable_tqdm=True,
            save_strategy="no", deepspeed={"zero_optimization": {"stage": stage}})

    def losses(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    with zero3_init(args("a")):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
    ZeroTrainer(model=model, args=args("a"), train_dataset=data).train()
    middle = _full(model)
    second = ZeroTrainer(model=model, args=args("b"), train_dataset=data)
    second.train()
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(middle, strict=False)
    reference = ZeroTrainer(model=plain, args=args("c"), train_dataset=data)
    reference.train()
    return losses(second), losses(reference)


def test_a_second_trainer_trains_the_same_model(worlds, tmp_path):
    """The second ZeroTrainer closes the first one's engine (stage 2: its hooks took the
    gradients; stage 3: its gathered units were refused as overwritten parameters)."""
    import pytest
    pytest.importorskip("transformers")
    for stage in (2, 3):
        for second, reference in worlds.run(2, _two_trainers, str(tmp_path), stage):
            assert len(second) == 2 and second == reference, (stage, second, reference)


def _closed_engine_refuses(rank, world, root):
    """A closed engine's every public method refuses by name: above all, its
    ``load_checkpoint`` must not rewrite the model a new engine now trains."""
    import zerotrain
    from zerotrain.errors import StateError
    model = R.make_model()
    old, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=2))
    _train(old, rank, 0)
    old.save_checkpoint(root, tag="old")
    new, *_ = zerotrain.initialize(model=model, config=R.engine_config(stage=2))  # takes over
    _train(new, rank, 2)
    before = _full(model)
    refused = {}
    calls = {"load_checkpoint": lambda: old.load_checkpoint(root, tag="old"),
             "save_checkpoint": lambda: old.save_checkpoint(root, tag="again"),
             "wait_for_checkpoint": old.wait_for_checkpoint, "get_lr": old.get_lr,
             "step": old.step, "zero_grad": old.zero_grad,
             "load_state_dict": lambda: old.load_state_dict(old.state_dict()),
             "eval": old.eval}
    for name, call in calls.items():
        try:
            call()
            refused[name] = None
        except StateError as exc:
            refused[name] = str(exc)
    # reads of its config and of its last step's numbers stay allowed: they touch nothing
    refused["reads"] = (old.train_batch_size() == new.train_batch_size(),
                        old.zero_optimization_stage(),
                        old.get_global_grad_norm() is not None)
    old.destroy()   # still allowed: does nothing
    unchanged = R.max_diff(before, _full(model))
    _train(new, rank, 4)
    new.destroy()
    return refused, unchanged


def test_a_closed_engine_refuses_every_public_method_by_name(worlds, tmp_path):
    for refused, unchanged in worlds.run(2, _closed_engine_refuses, str(tmp_path)):
        assert unchanged == 0.0, unchanged
        assert refused.pop("reads") == (True, 2, True)
        for name, message in refused.items():
            called = "train()" if name == "eval" else f"{name}()"   # eval() is train(False)
            assert message is not None and message.startswith(f"{called} on a closed "
                                                              "engine"), (name, message)
