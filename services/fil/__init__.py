"""FIL service: hosts `backend: "fil"` tree models (XGBoost, LightGBM, Treelite checkpoints)."""
