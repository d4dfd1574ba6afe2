"""The evaluations a training run makes: every configured set, by all ranks together.

Results are flat `<set>_<metric>` keys: `zeroshot_acc1` for the held-out digits,
`imagenet_acc1`, `coco_image_retrieval_recall@1`, ... for eval.sets, `val_loss` and
`val_image_retrieval_recall@1`, ... for eval.val_data (`clipscale.eval.validation`).
"""

from __future__ import annotations

from clipscale.config import Config, eval_task
from clipscale.distributed import World
from clipscale.distributed import unwrap
from clipscale.eval.tasks import run_task
from clipscale.eval.validation import Validation
from clipscale.eval.zeroshot import evaluate_zeroshot, zeroshot_classifier


class Evaluator:
    def __init__(self, cfg: Config, data, towers, world: World, autocast):
        self.cfg, self.data, self.towers, self.world, self.autocast = cfg, data, towers, world, autocast
        self.tasks = [eval_task(entry) for entry in cfg.eval.sets]
        self.validation = Validation(cfg, towers, world, autocast) if cfg.eval.val_data else None

    def __call__(self, model) -> dict:
        unwrapped = unwrap(model)
        results = {}
        if self.cfg.eval.zeroshot and self.data.classnames:
            classifier = zeroshot_classifier(
                unwrapped, self.towers.tokenizer, self.data.classnames, self.data.templates, self.world.device,
                batch_size=self.cfg.eval.batch_size, autocast=self.autocast,
            )
            loader = self.data.val_loader(self.towers.val_transform, self.world, self.cfg.eval.batch_size)
            metrics = evaluate_zeroshot(unwrapped, classifier, loader, self.world.device, autocast=self.autocast, progress=False)
            results.update({f"zeroshot_{k}": v for k, v in metrics.items()})
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
