"""The evaluations a training run makes: every configured set, by all ranks together.

Results are flat `<set>_<metric>` keys: `zeroshot_acc1` for the held-out digits,
`imagenet_acc1`, `coco_image_retrieval_recall@1`, ... for eval.sets, `val_loss` and
`val_image_retrieval_recall@1`, ... for eval.val_data (`clipscale.eval.validation`).
"""

from __future__ import annotations

from clipscale.config import Config
from clipscale.distributed import World
from clipscale.distributed import unwrap
from clipscale.eval.tasks import check_data, digits_task, eval_task, run_task
from clipscale.eval.validation import Validation
from clipscale.precision import Autocast

HELD_OUT_DIGITS = "zeroshot"  # the digits held-out set's name, so its metrics are zeroshot_acc1, ...


class Evaluator:
    """Built after prepare_data: the digits held-out set is read from the manifest it writes."""

    def __init__(self, cfg: Config, towers, world: World, autocast: Autocast):
        self.cfg, self.towers, self.world, self.autocast = cfg, towers, world, autocast
        held_out = [digits_task(cfg.data.root, HELD_OUT_DIGITS)] if cfg.eval.zeroshot and cfg.data.kind == "digits" else []
        self.tasks = held_out + [eval_task(entry) for entry in cfg.eval.sets]
        for task in self.tasks:  # every path there before training starts: a TaskError names the set, field and path
            check_data(task)
        self.validation = Validation(cfg, towers, world, autocast) if cfg.eval.val_data else None

    def __call__(self, model) -> dict:
        unwrapped = unwrap(model)
        results = {}
        for task in self.tasks:
            metrics = run_task(
                task, unwrapped, self.towers.tokenizer, self.towers.val_transform, self.world.device,
                batch_size=self.cfg.eval.batch_size, workers=self.cfg.eval.workers, autocast=self.autocast,
                progress=self.world.is_main,
            )
            results.update({f"{task.name}_{k}": v for k, v in metrics.items()})
        if self.validation is not None:
            results.update(self.validation(model))
        return results
