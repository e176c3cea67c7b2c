"""The maths both learning stages share: rollouts, returns and advantages, and the losses,
as plain functions with no file or CLI in sight."""
