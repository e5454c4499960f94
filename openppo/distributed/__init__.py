"""Ray process management: placement groups (`placement`), worker groups of Ray actors (`worker_group`) and their
base worker class (`worker`, importable without Ray: model workers also run in-process). Nothing is imported here,
so that importing `openppo.distributed.worker` does not import Ray."""
