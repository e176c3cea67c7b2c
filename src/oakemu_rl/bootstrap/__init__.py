"""Stages one and two: behaviour cloning and critic calibration."""
