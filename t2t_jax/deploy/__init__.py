"""Deployment: the CTranslate2 export and the CTranslate2 engine of translate and evaluate."""
