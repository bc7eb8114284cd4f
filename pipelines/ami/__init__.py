"""AMI's published pipelines (RolnickLab's AMI Data Companion, ``ami worker``) as data:
``catalogue`` (the table of slugs and stages), ``layouts`` (the module layouts AMI's checkpoints
were saved from), ``category_map`` (AMI's ``{label: index}`` JSON files)."""
