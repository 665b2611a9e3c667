# torchrun --standalone --nproc_per_node 2 hf_trainer_train.py
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.optim import AdamW          # the Adam recipe (the Trainer's default is torch's AdamW)


class TernGradCallback(TrainerCallback):
    """The Trainer has no comm-hook option and hands callbacks the unwrapped model: keep the trainer and
    register on trainer.model_wrapped (the DDP object) when training begins."""
    def __init__(self, trainer, **settings):
        self.trainer, self.settings, self.state = trainer, settings, None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size > 1 and self.state is None:
            self.state = tg_ddp.register(self.trainer, **self.settings)


class Windows(torch.utils.data.Dataset):
    def __init__(self, n=640, seq_len=64):
        self.x = torch.randint(0, 256, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


if __name__ == "__main__":
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir="hf_trainer_out", max_steps=20, per_device_train_batch_size=8,
                             learning_rate=2e-3, ddp_backend="gloo", use_cpu=True, report_to="none",
                             save_strategy="no")
    # the Trainer builds the optimizer from this class (its param groups, weight decay from args) and the
    # lr scheduler from args; or build both yourself: Trainer(..., optimizers=(opt, scheduler))
    trainer = Trainer(model=model, args=args, train_dataset=Windows(),
                      optimizer_cls_and_kwargs=(AdamW, {"lr": args.learning_rate,
                                                        "betas": (args.adam_beta1, args.adam_beta2),
                                                        "eps": args.adam_epsilon}))
    trainer.add_callback(TernGradCallback(trainer))       # TernGradCallback(trainer, packing="base3", ...)
    trainer.train()
